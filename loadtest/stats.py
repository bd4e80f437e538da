"""From one load point's raw measurements to the numbers in the report's tables.

A run (one model at one load) holds the per-request records the Locust users wrote, the metrics samples scraped
while it ran, and its measurement window ``[start, end)``: from the end of the ramp-up to the moment the load
generator stopped issuing requests. Latencies are taken over the requests that *started* in the window (each one
followed to its end, even after the window closed, up to the drain limit); throughput counts the tokens and
completions that *arrived* in the window, divided by its length. So a long request that outlives the window still
counts fully in the latency percentiles, and the load generator's start-up burst is left out. A request still
streaming at the drain limit is "cut off": its TTFT counts, its TPOT and E2E are unknown.

A window too short or too sparse to mean anything (:func:`not_measured`) gives no figures at all: the row keeps its
counts and says why, and the tables, plots, headline and ``make slo`` report it as "not measured".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from backend.contract import names
from loadtest import metrics
from loadtest.measure import meets_slo

PERCENTILES = (50, 90, 99)

# Below these a load point's rate and percentiles are noise: a p99 of 15 requests is their maximum, and a rate over a
# window of a second or two is one request more or less.
MIN_REQUESTS = 20
MIN_WINDOW_S = 5.0

# What a row keeps when its window is not measured: who, at what load, how many requests, and why.
COUNTS = (
    "model", "load", "users", "arrival_rate", "window_s", "num_requests", "num_failed", "num_failed_total",
    "num_unfinished", "errors", "budget_spent", "not_measured",
)  # fmt: skip


def percentile(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def started_in_window(run: dict) -> list[dict]:
    start, end = run["window"]
    return [r for r in run["requests"] if start <= r["t_start"] < end]


def budget_spent(run: dict) -> bool:
    """Whether the load generator stopped issuing because its request budget (``--max-requests``) ran out."""
    return any(e.get("event") == "stop_issuing" and e.get("reason") == "max_requests" for e in run.get("events", []))


def not_measured(num_requests: int, window_s: float, spent: bool = False) -> str | None:
    """Why a load point's window gives no figures (no rate, no percentile, no SLO verdict), or None when it does.

    ``num_requests`` started in a window of ``window_s`` seconds; ``spent``: the request budget ran out, which is
    what ended the window. A spent budget with enough requests in a long enough window is measured as usual.
    """
    if num_requests >= MIN_REQUESTS and window_s >= MIN_WINDOW_S:
        return None
    seen = f"{num_requests} request{'' if num_requests == 1 else 's'} in {window_s:.3g} s"
    if spent:
        return f"request budget spent ({seen})"
    if num_requests < MIN_REQUESTS:
        return f"{seen}: too few to measure"
    return f"{seen}: window too short to measure"


def summarize(run: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """One table row: throughput, latency percentiles, failures, goodput, and what the server's metrics said.

    ``row["not_measured"]`` is None, or the reason the window gives no figures; then every figure is None and only
    the keys in :data:`COUNTS` keep their values.
    """
    start, end = run["window"]
    span = max(end - start, 1e-9)
    measured = started_in_window(run)
    ok, cut, failed, ttft, tpot = _outcomes(measured)
    e2e = [r["e2e_ms"] for r in ok]
    within_slo = [r for r in ok if meets_slo(r, slo_ttft_ms, slo_tpot_ms)]
    tokens_in_window, completed_in_window = _arrived_in_window(run["requests"], start, end)

    row = {
        "model": run["model"],
        "load": run["load"],
        "users": run["users"],
        "arrival_rate": run.get("arrival_rate") or 0.0,
        "window_s": end - start,
        "num_requests": len(measured),
        "num_failed": len(failed),
        "num_failed_total": sum(1 for r in run["requests"] if not r["ok"] and not r.get("cut")),
        "num_unfinished": len(cut),
        "req_per_s": completed_in_window / span,
        "output_tok_per_s": tokens_in_window / span,
        "goodput_req_per_s": len(within_slo) / span,
        "goodput_fraction": len(within_slo) / len(measured) if measured else None,
        "mean_output_tokens": float(np.mean([r["num_output_tokens"] for r in ok])) if ok else None,
        "errors": sorted({r["error"] for r in failed if r["error"]})[:5],
        "budget_spent": budget_spent(run),
    }
    for q in PERCENTILES:
        row[f"ttft_p{q}_ms"] = percentile(ttft, q)
        row[f"tpot_p{q}_ms"] = percentile(tpot, q)
        row[f"e2e_p{q}_ms"] = percentile(e2e, q)
    row.update(server_view(run["metrics"], start, end))
    row.update(cpu_view(run["metrics"], start, end))
    row["not_measured"] = not_measured(len(measured), end - start, row["budget_spent"])
    if row["not_measured"]:
        row = {key: (value if key in COUNTS else None) for key, value in row.items()}
    return row


@dataclass(frozen=True)
class LoadPointRow:
    """What one load point measured, as the report's tables, plots and headline read it: :func:`summarize`'s row,
    typed. Its fields are the row's keys in the row's order, so :meth:`to_json` gives back the very dict
    (``summary.json`` and the run's record keep it). Every figure is None when the window was not measured."""

    model: str
    load: str
    users: int
    arrival_rate: float
    window_s: float
    num_requests: int
    num_failed: int
    num_failed_total: int
    num_unfinished: int
    req_per_s: float | None
    output_tok_per_s: float | None
    goodput_req_per_s: float | None
    goodput_fraction: float | None
    mean_output_tokens: float | None
    errors: list[str]
    budget_spent: bool
    ttft_p50_ms: float | None
    tpot_p50_ms: float | None
    e2e_p50_ms: float | None
    ttft_p90_ms: float | None
    tpot_p90_ms: float | None
    e2e_p90_ms: float | None
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None
    e2e_p99_ms: float | None
    # what the server's metrics said over the window (server_view)
    mean_batch_size: float | None
    steps_per_s: float | None
    mean_running: float | None
    mean_waiting: float | None
    mean_queued_in_triton: float | None
    mean_kv_blocks_used: float | None
    mean_waiting_total: float | None
    max_kv_blocks_used: float | None
    kv_blocks_total: float | None
    preemptions: float | None
    mean_iteration_gap_ms: float | None
    # CPU in percent of one core (cpu_view)
    loadgen_cpu_mean: float | None
    loadgen_cpu_max: float | None
    server_cpu_mean: float | None
    server_cpu_max: float | None
    not_measured: str | None

    @classmethod
    def summarize(cls, run: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> LoadPointRow:
        return cls(**summarize(run, slo_ttft_ms, slo_tpot_ms))

    @property
    def measured(self) -> bool:
        return not self.not_measured

    @property
    def load_key(self) -> tuple[float, int]:
        """(arrival rate, users): the load point, the same for every model run at it."""
        return self.arrival_rate, self.users

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _outcomes(measured: list[dict]) -> tuple[list, list, list, list, list]:
    """The requests that finished, were cut off and failed, and the TTFTs and TPOTs they give."""
    ok = [r for r in measured if r["ok"]]
    cut = [r for r in measured if r.get("cut")]
    failed = [r for r in measured if not r["ok"] and not r.get("cut")]
    # NOTE: a request the end of the run cut off still has a real TTFT if its first token came.
    ttft = [r["ttft_ms"] for r in ok + cut if r["ttft_ms"] is not None]
    tpot = [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]
    return ok, cut, failed, ttft, tpot


def _arrived_in_window(requests: list[dict], start: float, end: float) -> tuple[int, int]:
    """The tokens of ``requests`` that arrived in ``[start, end)``, and how many of them completed there."""
    tokens = completed = 0
    for r in requests:
        times = r["t_start"] + np.asarray(r["token_ms"], dtype=float) / 1000.0
        tokens += int(np.count_nonzero((times >= start) & (times < end)))
        if r["ok"] and start <= r["t_start"] + r["e2e_ms"] / 1000.0 < end:
            completed += 1
    return tokens, completed


def class_tok_per_s(run: dict, traffic_class: str) -> float:
    """The output tokens/s of one class of a mixed workload's run: its tokens that arrived in the window, over the
    window. A rate of tokens, not of requests: a class of a few long requests gives one too (batch jobs), where
    :func:`summarize_classes` finds too few requests to measure its latencies."""
    start, end = run["window"]
    requests = [r for r in run["requests"] if r.get("class") == traffic_class]
    return _arrived_in_window(requests, start, end)[0] / max(end - start, 1e-9)


# A class's row, as summary.json keeps it ("class" is a keyword: hence the functional form).
ClassRow = TypedDict("ClassRow", {
    "model": str, "load": str, "priorities": bool, "class": str, "priority": "int | None", "num_requests": int,
    "num_failed": int, "output_tok_per_s": "float | None", "ttft_p50_ms": "float | None",
    "ttft_p99_ms": "float | None", "tpot_p50_ms": "float | None", "tpot_p99_ms": "float | None",
    "within_targets": "float | None", "targets_met": "bool | None", "not_measured": "str | None",
})  # fmt: skip

# What a class's row keeps when its window is not measured.
CLASS_COUNTS = ("model", "load", "priorities", "class", "priority", "num_requests", "num_failed", "not_measured")


def summarize_classes(run: dict, classes: list[dict]) -> list[ClassRow]:
    """A mixed workload's run, one row per traffic class (``classes``: each class as
    ``workloads.TrafficClass.describe`` keeps it): its output tokens/s, TTFT and TPOT p50/p99 over the window as
    :func:`summarize` takes them, and for a class with latency targets the share of its requests within both
    (``within_targets``) and whether both p99s held (``targets_met``). A class too sparse in the window to measure
    says why, as a load point does (:func:`not_measured`)."""
    start, end = run["window"]
    rows = []
    for c in classes:
        requests = [r for r in run["requests"] if r.get("class") == c["name"]]
        measured = [r for r in requests if start <= r["t_start"] < end]
        ok, _, failed, ttft, tpot = _outcomes(measured)
        row = {
            "model": run["model"],
            "load": run["load"],
            "priorities": bool(run.get("priorities")),
            "class": c["name"],
            "priority": c["priority"] if run.get("priorities") else None,
            "num_requests": len(measured),
            "num_failed": len(failed),
            "output_tok_per_s": class_tok_per_s(run, c["name"]),
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50),
            "tpot_p99_ms": percentile(tpot, 99),
            "within_targets": None,
            "targets_met": None,
        }
        if c.get("ttft_ms") is not None and measured:
            within = [r for r in ok if meets_slo(r, c["ttft_ms"], c["tpot_ms"])]
            row["within_targets"] = len(within) / len(measured)
            row["targets_met"] = bool(row["ttft_p99_ms"] is not None and row["ttft_p99_ms"] <= c["ttft_ms"]
                                      and (row["tpot_p99_ms"] or 0.0) <= c["tpot_ms"])
        row["not_measured"] = not_measured(len(measured), end - start)
        if row["not_measured"]:
            row = {key: (value if key in CLASS_COUNTS else None) for key, value in row.items()}
        rows.append(row)
    return rows


def server_view(samples: list[dict], start: float, end: float) -> dict:
    """Means over the window of what the server exported: batch size per step, running/waiting, KV blocks."""
    inside = [s for s in samples if start <= s["t"] <= end]
    steps = metrics.histogram_rate(inside, names.BATCH_SIZE)
    num_steps = sum(rate for _, rate, _ in steps)  # weights: steps per second in each interval
    view = {
        "mean_batch_size": sum(rate * mean for _, rate, mean in steps) / num_steps if num_steps else None,
        "steps_per_s": float(np.mean([rate for _, rate, _ in steps])) if steps else None,
    }
    for key, name in (
        ("mean_running", names.NUM_REQUESTS_RUNNING),
        ("mean_waiting", names.NUM_REQUESTS_WAITING),
        ("mean_queued_in_triton", names.PENDING_REQUESTS),
        ("mean_kv_blocks_used", names.KV_BLOCKS_USED),
    ):
        values = [v for _, v in metrics.gauge(inside, name)]
        view[key] = float(np.mean(values)) if values else None
    # NOTE: llm_dynamic's requests wait in Triton's queue (its engine never has a waiting one), llm_continuous's in
    # the engine's: the sum is what "waiting" means for either.
    queues = [view["mean_waiting"], view["mean_queued_in_triton"]]
    view["mean_waiting_total"] = sum(q for q in queues if q is not None) if queues != [None, None] else None
    used = [v for _, v in metrics.gauge(inside, names.KV_BLOCKS_USED)]
    total = [v for _, v in metrics.gauge(samples, names.KV_BLOCKS_TOTAL)]
    view["max_kv_blocks_used"] = max(used) if used else None
    view["kv_blocks_total"] = total[-1] if total else None
    preempted = metrics.counter_delta(inside, names.PREEMPTIONS)
    view["preemptions"] = preempted
    # llm_iterative only: what handing the batch back to Triton cost per iteration.
    gaps = metrics.counter_delta(inside, f"{names.ITERATION_GAP}_count")
    gap_s = metrics.counter_delta(inside, f"{names.ITERATION_GAP}_sum")
    view["mean_iteration_gap_ms"] = 1000 * gap_s / gaps if gaps and gap_s is not None else None
    return view


def cpu_view(samples: list[dict], start: float, end: float) -> dict:
    """CPU use (percent of one core) of the load generator and the server during the window."""
    view = {}
    for who in ("loadgen", "server"):
        values = [s["cpu"][who] for s in samples if start <= s["t"] <= end and who in s.get("cpu", {})]
        view[f"{who}_cpu_mean"] = float(np.mean(values)) if values else None
        view[f"{who}_cpu_max"] = float(np.max(values)) if values else None
    return view


def idle_cpu(run: dict) -> dict[str, float]:
    """Mean CPU (percent of one core) over the run's window of each server meant to sit idle meanwhile (the
    ``idle <name>`` readings of ``runner.run_load_point``), by name."""
    start, end = run["window"]
    within = [s.get("cpu", {}) for s in run["metrics"] if start <= s["t"] <= end]
    names_seen = {name for cpu in within for name in cpu if name.startswith(metrics.IDLE)}
    return {name.removeprefix(metrics.IDLE): float(np.mean([cpu[name] for cpu in within if name in cpu]))
            for name in sorted(names_seen)}


def batch_size_distribution(run: dict) -> dict[str, float]:
    """Fraction of forward steps by batch-size bucket over the whole run (from the histogram's buckets)."""
    samples = [s for s in run["metrics"] if any(k.startswith(f"{names.BATCH_SIZE}_bucket") for k in s["values"])]
    if len(samples) < 2:
        return {}
    counts = metrics.histogram_delta(samples[0]["values"], samples[-1]["values"], names.BATCH_SIZE)
    total = sum(counts.values())
    return {le: c / total for le, c in counts.items() if c} if total else {}


def headline_point(
    rows: list[LoadPointRow], baseline: str, candidate: str, max_num_seqs: int | None = None
) -> tuple[LoadPointRow, LoadPointRow] | None:
    """The rows of ``baseline`` and ``candidate`` at the saturation point where both were measured: the highest load
    with no more users than ``max_num_seqs`` (every user fits in the batch at once; beyond that every model queues),
    else the highest load.
    """
    by_load: dict[tuple[float, int], dict[str, LoadPointRow]] = {}
    for row in rows:
        if row.measured:
            by_load.setdefault(row.load_key, {})[row.model] = row
    common = [key for key, models in by_load.items() if baseline in models and candidate in models]
    fitting = [(rate, users) for rate, users in common if not rate and max_num_seqs and users <= max_num_seqs]
    if not common:
        return None
    key = max(fitting or common)
    return by_load[key][baseline], by_load[key][candidate]


def ratio(numerator, denominator) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def headline(
    rows: list[LoadPointRow], baseline: str = names.DYNAMIC, candidate: str = names.CONTINUOUS,
    max_num_seqs: int | None = None,
) -> str:
    """E.g. ``continuous vs dynamic at 8 users: 2.7x output tokens/s, 14x lower TTFT p99``."""
    pair = headline_point(rows, baseline, candidate, max_num_seqs)
    if pair is None:
        return f"no load point measured both {baseline} and {candidate}"
    base, cand = pair
    tok = ratio(cand.output_tok_per_s, base.output_tok_per_s)
    ttft = ratio(base.ttft_p99_ms, cand.ttft_p99_ms)
    good = ratio(cand.goodput_req_per_s, base.goodput_req_per_s)
    parts = [f"{_x(tok)} output tokens/s ({cand.output_tok_per_s:.0f} vs {base.output_tok_per_s:.0f})"]
    if ttft is not None:
        parts.append(f"{_x(ttft)} lower TTFT p99 ({_s(cand.ttft_p99_ms)} vs {_s(base.ttft_p99_ms)})")
    if good is not None:
        parts.append(f"{_x(good)} goodput")
    elif cand.goodput_req_per_s and not base.goodput_req_per_s:
        parts.append(f"goodput {cand.goodput_req_per_s:.2f} vs 0 req/s")
    return f"{names.short_name(candidate)} vs {names.short_name(baseline)} at {cand.load}: " + ", ".join(parts)


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def _s(ms: float | None) -> str:
    if ms is None:
        return "n/a"
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"
