"""What the soak runs and how long it should take: its cells (a pattern, a number of clients, a model) grouped by the
server that serves them, the requests each cell sends, and the soak's expected duration from the rates of a kept soak
record (``records/runs/soak-<cpu>.json``).

A cell with several clients on a model that batches by itself (llm_continuous, llm_iterative, llm_dynamic) sends
``--requests`` per round; a cell of one client, and every cell of llm_static, ``--light-requests``: one client
sends one request at a time, and llm_static's batcher waits up to a second for a full batch, so those cells cost
seconds per request where the others cost a fraction of one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from backend.contract.names import STATIC
from records.record import RUNS, Record

RECORD_NAME = "soak"  # records/runs/soak-<cpu>.json


@dataclass(frozen=True)
class Group:
    """The cells one server serves, in turn, every round: one pattern and one number of clients on each model;
    ``requests``: per model, the requests of its cell in each round."""

    pattern: str
    clients: int
    requests: dict[str, int]

    @property
    def models(self) -> list[str]:
        return list(self.requests)

    @property
    def name(self) -> str:
        return f"{self.pattern}-x{self.clients}"


def requests_per_round(model: str, num_clients: int, requests: int, light_requests: int) -> int:
    """The requests of a cell in one round: ``light_requests`` for one client or llm_static, else ``requests``."""
    return light_requests if num_clients == 1 or model == STATIC else requests


def plan(patterns: list[str], clients: list[int], models: list[str], requests: int, light_requests: int) -> list[Group]:
    """The soak's servers in the order it runs them: each pattern, each number of clients."""
    return [Group(pattern, num_clients,
                  {model: requests_per_round(model, num_clients, requests, light_requests) for model in models})
            for pattern in patterns for num_clients in clients]


def side_by_side(groups: list[Group]) -> list[list[int]]:
    """The groups (by index) that run at once, each on its own server: those of one pattern. One client's cells cost
    little CPU (llm_static's mostly wait for its batcher), so beside the cells of 8 clients they hide their
    seconds at little cost to them."""
    batches: dict[str, list[int]] = {}
    for index, group in enumerate(groups):
        batches.setdefault(group.pattern, []).append(index)
    return list(batches.values())


def total_requests(groups: list[Group], rounds: int) -> int:
    return rounds * sum(sum(group.requests.values()) for group in groups)


# ---- the expected duration, from a kept record ----------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    """What a kept soak took: seconds per request of each cell (``(pattern, clients, model)``), seconds after each
    cell (settling and the full batch) per round, and seconds to start and to stop a server."""

    source: str  # the record's path, commit and CPU, in words
    per_request: dict[tuple[str, int, str], float]
    after_cell: dict[tuple[str, int, str], float]
    start_s: float
    stop_s: float

    @classmethod
    def from_record(cls, path: Path) -> "Rates":
        record = Record.read(path)
        rounds = max(1, int(record.settings.get("rounds", 1)))
        per_request, after_cell = {}, {}
        for row in record.tables["cells"].rows:
            key = (row["pattern"], int(row["clients"]), row["model"])
            if row.get("requests"):
                per_request[key] = row["load_s"] / row["requests"]
                after_cell[key] = row["after_s"] / rounds
        servers = record.tables["servers"].rows
        mean = lambda key: sum(r[key] or 0 for r in servers) / max(1, len(servers))  # noqa: E731
        p = record.provenance
        machine = record.tables["machine"].rows[0] if "machine" in record.tables else {}
        load = (f", a mean load average of {machine['load_mean']:.1f} on {machine['cpus']} CPUs"
                if machine.get("load_mean") is not None else "")
        source = (f"{path.name} (commit {(p.get('commit') or '?')[:7]}, {p.get('date', '?')[:10]}, "
                  f"{p.get('cpu', {}).get('model', '?')}{load})")
        return cls(source, per_request, after_cell, mean("start_s"), mean("stop_s"))

    def cell_seconds(self, pattern: str, num_clients: int, model: str, requests: int) -> float | None:
        """Seconds a cell of ``requests`` should take, with what follows it; None when the record has no cell of
        this number of clients to go by. A cell it lacks goes by its cells of the same clients and model, else of
        the same clients."""
        key = (pattern, num_clients, model)
        if key in self.per_request:
            return requests * self.per_request[key] + self.after_cell[key]
        for like in (lambda k: k[1] == num_clients and k[2] == model, lambda k: k[1] == num_clients):
            keys = [k for k in self.per_request if like(k)]
            if keys:
                return (requests * sum(self.per_request[k] for k in keys) / len(keys)
                        + sum(self.after_cell[k] for k in keys) / len(keys))
        return None


def find_rates(cpu_slug: str, runs: Path = RUNS) -> Rates | None:
    """The rates of the kept soak record of this CPU, else of any kept soak record; None when none is kept."""
    own = runs / f"{RECORD_NAME}-{cpu_slug}.json"
    candidates = [own] if own.exists() else sorted(runs.glob(f"{RECORD_NAME}-*.json"))
    for path in candidates:
        try:
            return Rates.from_record(path)
        except (OSError, KeyError, ValueError, json.JSONDecodeError):
            continue
    return None


@dataclass(frozen=True)
class Estimate:
    seconds: float
    by_cell: dict[tuple[str, int, str], float]  # per round
    unknown: list[tuple[str, int, str]]  # cells the rates say nothing about (left out of ``seconds``)
    source: str


def estimate(groups: list[Group], rounds: int, rates: Rates) -> Estimate:
    """The soak's expected duration: each server's start, every cell of every round at the kept rates (the rates of
    cells that ran side by side, as they will), and its stop; the groups that run side by side take as long as the
    longest of them."""
    by_cell, unknown, group_seconds = {}, [], []
    for group in groups:
        seconds_of_group = rates.start_s + rates.stop_s
        for model, requests in group.requests.items():
            seconds = rates.cell_seconds(group.pattern, group.clients, model, requests)
            if seconds is None:
                unknown.append((group.pattern, group.clients, model))
            else:
                by_cell[(group.pattern, group.clients, model)] = seconds
                seconds_of_group += rounds * seconds
        group_seconds.append(seconds_of_group)
    total = sum(max(group_seconds[i] for i in batch) for batch in side_by_side(groups))
    return Estimate(total, by_cell, unknown, rates.source)


def duration(seconds: float) -> str:
    """'1 h 48 min', '12 min', '40 s'."""
    minutes = round(seconds / 60)
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"
