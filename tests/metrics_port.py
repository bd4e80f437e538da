"""What the server tests read from Triton's metrics port at one moment: the ``llm_*`` samples, keyed as the port
prints them, and one model's sample among them."""

from __future__ import annotations

import requests

from backend.contract import names
from backend.contract.prometheus import Series, parse_prometheus


def scrape_metrics(metrics_url: str) -> dict[str, float]:
    """The ``llm_*`` samples of Triton's metrics port, keyed by name with labels as printed (``requests`` errors
    propagate)."""
    series = parse_prometheus(requests.get(metrics_url, timeout=10).text)
    return {printed(s): s.value for s in series if s.name.startswith(names.METRIC_PREFIX)}


def printed(series: Series) -> str:
    """``name{label="value",...}`` as the metrics port prints it (labels in its order)."""
    if not series.labels:
        return series.name
    return series.name + "{" + ",".join(f'{k}="{v}"' for k, v in series.labels.items()) + "}"


def model_sample(samples: dict[str, float], name: str, model: str) -> float:
    """``name{model="..."}`` from :func:`scrape_metrics`'s samples; NaN when absent."""
    return samples.get(f'{name}{{model="{model}"}}', float("nan"))
