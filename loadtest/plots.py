"""The report's pictures (matplotlib, no display needed). Each function writes one PNG and returns its path."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from backend.contract import names  # noqa: E402
from loadtest import metrics  # noqa: E402
from loadtest.colors import color  # noqa: E402
from loadtest.stats import LoadPointRow, batch_size_distribution, started_in_window  # noqa: E402


def _x(row: LoadPointRow) -> float:
    return row.arrival_rate or row.users


def _x_label(rows: list[LoadPointRow]) -> str:
    return (
        "offered load (requests/s, Poisson)"
        if any(r.arrival_rate for r in rows)
        else "concurrent users (closed loop)"
    )


def _load_axis(ax, rows: list[LoadPointRow]) -> None:
    """Ticks at the measured load points (1, 4, 8, 16 users), on a log-2 axis when they span a wide range."""
    xs = sorted({_x(r) for r in rows if r.measured})
    if xs and xs[0] > 0 and xs[-1] / xs[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    if ax.get_xscale() == "log":
        ax.minorticks_off()
    ax.set_xlabel(_x_label(rows))


def _by_model(rows: list[LoadPointRow]) -> dict[str, list[LoadPointRow]]:
    """The measured rows per model, by load; a point whose window was not measured has nothing to plot."""
    grouped: dict[str, list[LoadPointRow]] = {}
    for row in rows:
        if row.measured:
            grouped.setdefault(row.model, []).append(row)
    return {m: sorted(rs, key=_x) for m, rs in grouped.items()}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_vs_load(rows: list[LoadPointRow], path: Path) -> Path:
    fig, (ax_tok, ax_req) = plt.subplots(1, 2, figsize=(11, 4))
    for model, rs in _by_model(rows).items():
        xs = [_x(r) for r in rs]
        ax_tok.plot(xs, [r.output_tok_per_s for r in rs], "o-", color=color(model), label=model)
        ax_req.plot(xs, [r.req_per_s for r in rs], "o-", color=color(model), label=f"{model} completed")
        ax_req.plot(
            xs,
            [r.goodput_req_per_s for r in rs],
            "s--",
            color=color(model),
            alpha=0.6,
            label=f"{model} goodput (within SLO)",
        )
    ax_tok.set(title="Output tokens per second", ylabel="tokens/s")
    ax_req.set(title="Requests per second", ylabel="requests/s")
    for ax in (ax_tok, ax_req):
        _load_axis(ax, rows)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    return _save(fig, path)


def latency_vs_load(rows: list[LoadPointRow], path: Path, slo_ttft_ms: float, slo_tpot_ms: float) -> Path:
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4))
    for model, rs in _by_model(rows).items():
        xs = [_x(r) for r in rs]
        p50 = ([_s(r.ttft_p50_ms) for r in rs], [r.tpot_p50_ms for r in rs])
        p99 = ([_s(r.ttft_p99_ms) for r in rs], [r.tpot_p99_ms for r in rs])
        for q, style, (ttft, tpot) in ((50, "o-", p50), (99, "^--", p99)):
            ax_ttft.plot(xs, ttft, style, color=color(model), label=f"{model} p{q}")
            ax_tpot.plot(xs, tpot, style, color=color(model), label=f"{model} p{q}")
    ax_ttft.axhline(slo_ttft_ms / 1000, color="red", lw=0.8, ls=":", label="SLO (p99)")
    ax_tpot.axhline(slo_tpot_ms, color="red", lw=0.8, ls=":", label="SLO (p99)")
    ax_ttft.set(title="Time to first token", ylabel="seconds (log)", yscale="log")
    ax_tpot.set(title="Time per output token", ylabel="ms")
    ax_tpot.set_ylim(bottom=0)
    for ax in (ax_ttft, ax_tpot):
        _load_axis(ax, rows)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    return _save(fig, path)


def e2e_distribution(runs: list[dict], path: Path) -> Path:
    """Empirical CDF of end-to-end latency, one panel per load point, one line per model (``runs``: the measured
    ones; the report leaves out those whose window was not measured)."""
    loads = sorted({(r.get("arrival_rate") or 0.0, r["users"]) for r in runs})
    panels = max(1, len(loads))
    fig, axes = plt.subplots(1, panels, figsize=(3.6 * panels + 1, 3.6), squeeze=False, sharey=True)
    if not loads:
        axes[0][0].text(0.5, 0.5, "no load point measured", ha="center", va="center")
    for ax, load in zip(axes[0], loads):
        for run in runs:
            if (run.get("arrival_rate") or 0.0, run["users"]) != load:
                continue
            e2e = np.sort([r["e2e_ms"] / 1000 for r in started_in_window(run) if r["ok"]])
            if len(e2e):
                ax.step(
                    e2e,
                    np.arange(1, len(e2e) + 1) / len(e2e),
                    where="post",
                    color=color(run["model"]),
                    label=run["model"],
                )
            ax.set_title(run["load"])
        ax.set(xlabel="end-to-end latency (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][0].legend(fontsize=8)
    return _save(fig, path)


def batch_size_over_time(
    runs: list[dict], path: Path, max_num_seqs: int | None = None, seats: dict[str, int] | None = None
) -> Path:
    """The pictures of docs/batching.md, measured: the running batch over time, one row per model.

    Line: sequences in the running batch (the ``llm_num_requests_running`` gauge, sampled every 0.5 s). Dots: mean
    sequences per forward step between two samples (from the ``llm_batch_size`` histogram). Shaded: requests
    waiting (the engine's queue, plus Triton's own queue in front of a batcher model). Dotted: the seats, over all the
    model's instances (``seats``, else ``max_num_seqs``).
    """
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 2.6 * len(runs) + 0.6), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        t0 = _test_start(run)
        running = metrics.gauge(run["metrics"], names.NUM_REQUESTS_RUNNING)
        if running:
            ax.step(
                *_since(running, t0),
                where="post",
                color=color(run["model"]),
                lw=1.4,
                label="running batch (sampled)",
            )
        steps = metrics.histogram_rate(run["metrics"], names.BATCH_SIZE)
        if steps:
            ax.plot(
                [t - t0 for t, _, _ in steps],
                [m for _, _, m in steps],
                ".",
                color="black",
                ms=3,
                label="mean sequences per forward step",
            )
        waiting = _waiting(run["metrics"])
        if waiting:
            ax.fill_between(
                *_since(waiting, t0),
                step="post",
                color="tab:red",
                alpha=0.15,
                label="requests waiting",
            )
        limit = (seats or {}).get(run["model"], max_num_seqs)  # over all the model's instances
        if limit:
            ax.axhline(limit, color="black", lw=0.7, ls=":", label=f"seats ({limit})")
        start, end = run["window"]
        ax.axvspan(start - t0, end - t0, color="green", alpha=0.05, label="measured window")
        ax.set(ylabel="sequences", title=f"{run['model']} at {run['load']}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds since the load started")
    return _save(fig, path)


def kv_blocks_over_time(runs: list[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(11, 3.6))
    total = None
    for run in runs:
        t0 = _test_start(run)
        used = metrics.gauge(run["metrics"], names.KV_BLOCKS_USED)
        if used:
            ax.plot(
                *_since(used, t0),
                color=color(run["model"]),
                label=f"{run['model']} at {run['load']}",
            )
        totals = metrics.gauge(run["metrics"], names.KV_BLOCKS_TOTAL)
        total = totals[-1][1] if totals else total
    ax.set(
        title="KV-cache blocks in use" + (f" (pool: {total:.0f} blocks)" if total else ""),
        xlabel="seconds since the load started",
        ylabel="blocks",
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def batch_size_histogram(runs: list[dict], path: Path) -> Path:
    """Share of forward steps by batch size: how often each model ran nearly empty batches."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    dists = [(run, batch_size_distribution(run)) for run in runs]
    labels = sorted({le for _, d in dists for le in d}, key=lambda le: float("inf") if le == "+Inf" else float(le))
    width = 0.8 / max(1, len(dists))
    for i, (run, dist) in enumerate(dists):
        xs = np.arange(len(labels)) + i * width
        ax.bar(
            xs,
            [dist.get(le, 0.0) for le in labels],
            width,
            color=color(run["model"]),
            label=f"{run['model']} at {run['load']}",
        )
    ax.set_xticks(np.arange(len(labels)) + width * (len(dists) - 1) / 2, [f"≤{_le(le)}" for le in labels])
    ax.set(
        title="Forward steps by batch size",
        xlabel="sequences in the step (histogram bucket)",
        ylabel="fraction of steps",
    )
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _le(le: str) -> str:
    return le if le == "+Inf" else f"{float(le):g}"


def _s(ms):
    return None if ms is None else ms / 1000


def _since(series: list[tuple[float, float]], t0: float) -> tuple[list[float], list[float]]:
    """``(seconds since t0, values)`` of a gauge's ``(time, value)`` samples."""
    return [t - t0 for t, _ in series], [v for _, v in series]


def _test_start(run: dict) -> float:
    return next((e["t"] for e in run.get("events", []) if e.get("event") == "test_start"), run["window"][0])


def _waiting(samples: list[dict]) -> list[tuple[float, float]]:
    out = []
    for s in samples:
        values = [
            s["values"][k]
            for k in (names.NUM_REQUESTS_WAITING, names.PENDING_REQUESTS)
            if k in s["values"]
        ]
        if values:
            out.append((s["t"], sum(values)))
    return out
