"""Scrape Triton's metrics port while a load runs, and turn the samples into time series.

The models export (labelled ``model="..."``): gauges ``llm_num_requests_running``, ``llm_num_requests_waiting``,
``llm_kv_blocks_used``, ``llm_kv_blocks_total``; counters ``llm_*_total``; histograms ``llm_batch_size`` (sequences
per forward step), ``llm_time_to_first_token_seconds`` and others. Triton adds ``nv_inference_*`` per model;
``nv_inference_pending_request_count`` is the queue in front of ``llm_dynamic`` (its engine never has a waiting
request: Triton holds them until the running batch returns).

A sample is ``{"t": unix time, "values": {series: value}, "cpu": {process: percent of one core}, "steps":
{model: forward steps so far}}``; ``steps`` covers every model, so a run can tell which others were under load.
Series keys are ``name`` plus the labels other than ``model``, ``version`` and ``instance``
(``llm_request_success_total{finish_reason="length"}``): a model served by several instances exports each
instance's series (its own engine and KV pool) under an ``instance`` label, and a sample holds their sum.
Histogram buckets are kept only in the first and last sample of a run (enough for the run's distribution).
"""

from __future__ import annotations

import threading
import time

from backend.contract import names
from backend.contract.prometheus import Series, by_model, parse_prometheus, scrape

PREFIXES = (names.METRIC_PREFIX, names.TRITON_METRIC_PREFIX)
# A sample's CPU reading of a server other than the one under load, which should sit idle meanwhile: "idle <name>".
IDLE = "idle "


def series_key(name: str, labels: dict) -> str:
    rest = {k: v for k, v in labels.items() if k not in ("model", "version", "instance")}
    if not rest:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(rest.items())) + "}"


def select(series: list[Series], model: str, prefixes=PREFIXES, buckets: bool = True) -> dict[str, float]:
    """``{series key: value}`` of the series labelled ``model`` whose name starts with one of ``prefixes``; the
    series of the model's instances summed (blocks, requests, steps and counts all add up across instances)."""
    values: dict[str, float] = {}
    for s in series:
        if s.labels.get("model") != model or not s.name.startswith(prefixes):
            continue
        if not buckets and s.name.endswith("_bucket"):
            continue
        key = series_key(s.name, s.labels)
        values[key] = values.get(key, 0.0) + s.value
    return values


def steps_by_model(series: list[Series]) -> dict[str, float]:
    """Forward steps each model has run so far (the count of its ``llm_batch_size``, instances summed)."""
    return by_model(series, f"{names.BATCH_SIZE}_count")


def models_under_load(first: dict[str, float], last: dict[str, float]) -> list[str]:
    """The models that ran forward steps between two readings of :func:`steps_by_model`: those under load then.
    More than one means their engines shared the cores (``backend/engine/shared_cores.py``)."""
    return sorted(model for model, steps in last.items() if steps > first.get(model, steps))


class CpuMeter:
    """CPU use of named processes and their children, in percent of one core since the previous reading."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._roots: dict[str, int] = {}
        self._procs: dict[str, dict[int, object]] = {}  # per name: pid -> psutil.Process (keeps its CPU clock)

    def add(self, name: str, pid: int | None) -> None:
        if pid:
            self._procs[name] = {}
            self._roots[name] = pid  # last: the sampler thread may be reading

    def read(self) -> dict[str, float]:
        usage = {}
        for name, pid in list(self._roots.items()):
            try:
                root = self._psutil.Process(pid)
                tree = [root, *root.children(recursive=True)]
            except self._psutil.Error:
                continue
            known, total = self._procs[name], 0.0
            for proc in tree:
                proc = known.setdefault(proc.pid, proc)
                try:
                    total += proc.cpu_percent(None)  # NOTE: 0.0 on a process's first reading
                except self._psutil.Error:
                    known.pop(proc.pid, None)
            usage[name] = round(total, 1)
        return usage


class MetricsSampler:
    """Samples one model's metrics (and process CPU) every ``interval`` seconds on a thread until stopped.

    Missing or unreachable metrics are not an error: the run goes on and the samples say what was seen.
    """

    def __init__(self, url: str | None, model: str, interval: float = 0.5, pids: dict[str, int] | None = None):
        self.url, self.model, self.interval = url, model, interval
        self.pids = dict(pids or {})
        self.samples: list[dict] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metrics-{model}", daemon=True)

    def start(self) -> "MetricsSampler":
        self._cpu = CpuMeter()
        for name, pid in self.pids.items():
            self._cpu.add(name, pid)
        self._thread.start()
        return self

    def watch(self, name: str, pid: int) -> None:
        """Also measure this process (e.g. the load generator once it has started)."""
        self._cpu.add(name, pid)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample(buckets=True)  # the last sample keeps histogram buckets
        return self.samples

    def _run(self) -> None:
        self._sample(buckets=True)
        while not self._stop.wait(self.interval):
            self._sample(buckets=False)

    def _sample(self, buckets: bool) -> None:
        sample = {"t": time.time(), "values": {}, "cpu": self._cpu.read(), "steps": {}}
        if self.url:
            try:
                series = parse_prometheus(scrape(self.url))
                sample["values"] = select(series, self.model, buckets=buckets)
                sample["steps"] = steps_by_model(series)
            except OSError as exc:
                if len(self.errors) < 20:
                    self.errors.append(f"{time.time():.1f}: {exc}")
        self.samples.append(sample)


# ---- time series from samples -------------------------------------------------------------------------------


def gauge(samples: list[dict], name: str) -> list[tuple[float, float]]:
    """``(t, value)`` for every sample that has the series."""
    return [(s["t"], s["values"][name]) for s in samples if name in s["values"]]


def histogram_rate(samples: list[dict], name: str) -> list[tuple[float, float, float]]:
    """``(t_mid, observations per second, mean observed value)`` between consecutive samples of histogram ``name``.

    For ``llm_batch_size``: forward steps per second and the mean number of sequences per step in each interval.
    Intervals without observations are left out.
    """
    count, total = f"{name}_count", f"{name}_sum"
    points = [(s["t"], s["values"][count], s["values"][total]) for s in samples if count in s["values"]]
    out = []
    for (t0, c0, s0), (t1, c1, s1) in zip(points, points[1:]):
        if c1 > c0 and t1 > t0:
            out.append(((t0 + t1) / 2, (c1 - c0) / (t1 - t0), (s1 - s0) / (c1 - c0)))
    return out


def histogram_delta(first: dict, last: dict, name: str) -> dict[str, float]:
    """Observations per bucket (upper bound ``le`` -> count, not cumulative) between two samples' ``values``."""
    prefix = f'{name}_bucket{{le="'
    cumulative = []
    for key, value in last.items():
        if key.startswith(prefix):
            le = key[len(prefix) : -2]
            cumulative.append((float("inf") if le == "+Inf" else float(le), le, value - first.get(key, 0.0)))
    cumulative.sort()
    counts, previous = {}, 0.0
    for _, le, value in cumulative:
        counts[le] = value - previous
        previous = value
    return counts


def counter_delta(samples: list[dict], name: str) -> float | None:
    seen = [s["values"][name] for s in samples if name in s["values"]]
    return seen[-1] - seen[0] if len(seen) >= 2 else None
