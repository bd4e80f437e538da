"""Triton's metrics port as Prometheus text, read with the standard library: the one parser of that text, for the
stop (``shutdown.py``), the watchdog, the health probe and the load tests.

NOTE: standard library only (the package's rule, ``backend/contract/__init__.py``).
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Series:
    name: str
    labels: dict
    value: float


def parse_prometheus(text: str) -> list[Series]:
    """Every sample line of Prometheus text exposition; comments and malformed lines are skipped."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        found.append(Series(name, dict(_LABEL.findall(labels or "")), number))
    return found


def scrape(url: str, timeout: float = 2.0) -> str:
    """The metrics page; ``OSError`` (``urllib.error.URLError`` among them) when nothing answers."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode("utf-8", errors="replace")


def read(url: str, timeout: float = 2.0) -> list[Series] | None:
    """The series on the metrics page; None when the port does not answer."""
    try:
        return parse_prometheus(scrape(url, timeout))
    except OSError:
        return None


def by_model(series: list[Series], name: str) -> dict[str, float]:
    """``model -> value`` of the series ``name``, summed over the model's instances, versions and other labels
    (requests, steps and counts add up)."""
    values: dict[str, float] = {}
    for s in series:
        if s.name == name and "model" in s.labels:
            values[s.labels["model"]] = values.get(s.labels["model"], 0.0) + s.value
    return values
