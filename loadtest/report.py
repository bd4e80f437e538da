"""Turn a comparison's raw results (``results.json``) into report.md, a self-contained report.html and PNG plots.

    python -m loadtest.report reports/<timestamp>/results.json [--out DIR]     # rebuild a report

``results.json`` holds everything measured: ``meta`` (options, SLOs, machine) and ``runs`` (one per model and load
point: the per-request records, the metrics samples, the measurement window). The tables are computed here
(loadtest/stats.py), so a report can always be rebuilt from the raw data.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
from pathlib import Path

from backend.contract.names import CONTINUOUS, DYNAMIC, ITERATIVE, KV_BLOCKS_TOTAL, STATIC, model_order, short_name
from loadtest import metrics, plots
from loadtest.runner import BF16, weight_format
from loadtest.stats import MIN_REQUESTS, MIN_WINDOW_S, headline, headline_point, is_measured, ratio, summarize

BASELINE, CANDIDATE = DYNAMIC, CONTINUOUS  # the headline: continuous batching against Triton's dynamic batcher
DESIGN_NOTE = "docs/batching.md (the design note on static, dynamic and continuous batching)"


def is_dynamic_variant(model: str) -> bool:
    return model.startswith(BASELINE + "_")


# What each model beside the continuous one is, for its comparison table.
BESIDE = {
    STATIC: f"{STATIC} is the same engine behind Triton's batcher told to wait (up to its max_queue_delay) for a full "
    "batch before it runs one, and to run that batch to its longest member: the static batching of "
    f"{DESIGN_NOTE}, kept as a teaching baseline.",
    BASELINE: f"{BASELINE} is the same engine behind Triton's dynamic batcher as shipped: a batch forms within its "
    "max_queue_delay and runs to its longest member.",
    ITERATIVE: f"{ITERATIVE} is the same engine behind Triton's iterative sequence batcher: Triton forms the batch at "
    "every step, the model runs one step over it and hands the unfinished requests back.",
}

# (heading, row key, format) for the per-load-point table.
COLUMNS = [
    ("model", "model", "{}"),
    ("load", "load", "{}"),
    ("req/s", "req_per_s", "{:.2f}"),
    ("output tok/s", "output_tok_per_s", "{:.1f}"),
    ("TTFT p50", "ttft_p50_ms", "ms"),
    ("TTFT p90", "ttft_p90_ms", "ms"),
    ("TTFT p99", "ttft_p99_ms", "ms"),
    ("TPOT p50", "tpot_p50_ms", "ms"),
    ("TPOT p99", "tpot_p99_ms", "ms"),
    ("E2E p50", "e2e_p50_ms", "ms"),
    ("E2E p99", "e2e_p99_ms", "ms"),
    ("requests", "num_requests", "{}"),
    ("failures", "num_failed", "{}"),
    ("cut off", "num_unfinished", "{}"),
    ("goodput req/s", "goodput_req_per_s", "{:.2f}"),
    ("within SLO", "goodput_fraction", "{:.0%}"),
    ("mean batch", "mean_batch_size", "{:.2f}"),
    ("steps/s", "steps_per_s", "{:.1f}"),
    ("mean waiting", "mean_waiting_total", "{:.1f}"),
    ("server CPU", "server_cpu_mean", "{:.0f}%"),
    ("loadgen CPU", "loadgen_cpu_mean", "{:.0f}%"),
]


def fmt(value, spec: str) -> str:
    if value is None:
        return "–"
    if spec == "ms":
        return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"
    return spec.format(value)


def table_rows(rows: list[dict]) -> list[list[str]]:
    """One line per row; a row whose window was not measured says so, with the reason, where its rate would be."""
    out = []
    for row in rows:
        cells = [fmt(row.get(key), spec) for _, key, spec in COLUMNS]
        if not is_measured(row):
            cells[2] = f"not measured: {row['not_measured']}"
        out.append(cells)
    return out


def comparison_rows(rows: list[dict], baseline: str = BASELINE, candidate: str = CANDIDATE) -> list[list[str]]:
    """Per load point, the candidate beside the baseline: ratios of throughput and latency (or why there are none)."""
    out = []
    by_load: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        by_load.setdefault((row["arrival_rate"], row["users"]), {})[row["model"]] = row
    for load in sorted(by_load):
        base, cand = by_load[load].get(baseline), by_load[load].get(candidate)
        if base is None or cand is None:
            continue
        unmeasured = [f"{r['model']}: {r['not_measured']}" for r in (cand, base) if not is_measured(r)]
        if unmeasured:
            out.append([cand["load"], "not measured (" + "; ".join(unmeasured) + ")"] + ["–"] * 6)
            continue
        out.append([
            cand["load"],
            fmt(ratio(cand["output_tok_per_s"], base["output_tok_per_s"]), "{:.2f}x"),
            fmt(ratio(cand["req_per_s"], base["req_per_s"]), "{:.2f}x"),
            fmt(ratio(base["ttft_p50_ms"], cand["ttft_p50_ms"]), "{:.1f}x"),
            fmt(ratio(base["ttft_p99_ms"], cand["ttft_p99_ms"]), "{:.1f}x"),
            fmt(ratio(base["tpot_p99_ms"], cand["tpot_p99_ms"]), "{:.2f}x"),
            fmt(ratio(base["e2e_p99_ms"], cand["e2e_p99_ms"]), "{:.1f}x"),
            f"{fmt(cand['goodput_req_per_s'], '{:.2f}')} vs {fmt(base['goodput_req_per_s'], '{:.2f}')}",
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
    slo_ttft, slo_tpot = meta["slo"]["ttft_ms"], meta["slo"]["tpot_ms"]
    runs = sorted(results["runs"], key=lambda r: (model_order(r["model"]), r.get("arrival_rate") or 0.0, r["users"]))
    rows = [summarize(run, slo_ttft, slo_tpot) for run in runs]
    line = headline(rows, BASELINE, CANDIDATE, meta.get("max_num_seqs"))

    timeline_runs = _timeline_runs(runs, rows, meta.get("max_num_seqs"))
    images = {
        "throughput": plots.throughput_vs_load(rows, out_dir / "throughput_vs_load.png"),
        "latency": plots.latency_vs_load(rows, out_dir / "latency_vs_load.png", slo_ttft, slo_tpot),
        "e2e": plots.e2e_distribution(
            [run for run, row in zip(runs, rows) if is_measured(row)], out_dir / "e2e_latency_cdf.png"
        ),
    }
    if timeline_runs:
        images["batch"] = plots.batch_size_over_time(
            timeline_runs, out_dir / "batch_size_over_time.png", meta.get("max_num_seqs"), _seats(meta)
        )
        images["kv"] = plots.kv_blocks_over_time(timeline_runs, out_dir / "kv_blocks_over_time.png")
        images["batch_hist"] = plots.batch_size_histogram(timeline_runs, out_dir / "batch_size_histogram.png")

    sections = _sections(meta, runs, rows, line, images, timeline_runs)
    (out_dir / "report.md").write_text(_markdown(sections))
    (out_dir / "report.html").write_text(_html(sections))
    (out_dir / "summary.json").write_text(json.dumps({"headline": line, "rows": rows}, indent=1))
    return {
        "rows": rows,
        "headline": line,
        "images": images,
        "md": out_dir / "report.md",
        "html": out_dir / "report.html",
    }


def _seats(meta: dict) -> dict[str, int]:
    """Sequences each model can run at once over all its instances, from the configurations served."""
    seats = {}
    for model, c in meta.get("configs", {}).items():
        per_instance = c.get("max_num_seqs")
        if per_instance and str(per_instance).isdigit():
            seats[model] = int(per_instance) * (c.get("instance_count") or 1)
    return seats


def _timeline_runs(runs: list[dict], rows: list[dict], max_num_seqs: int | None) -> list[dict]:
    """The measured runs at the headline load point, one per model, for the time plots."""
    measured = {(r["model"], r["arrival_rate"], r["users"]) for r in rows if is_measured(r)}
    pair = headline_point(rows, BASELINE, CANDIDATE, max_num_seqs)
    if pair is not None:
        key = (pair[0]["arrival_rate"], pair[0]["users"])
    elif measured:
        key = max((rate, users) for _, rate, users in measured)
    else:
        return []
    chosen = [run for run in runs if (run["model"], run.get("arrival_rate") or 0.0, run["users"]) in measured]
    chosen = [run for run in chosen if ((run.get("arrival_rate") or 0.0), run["users"]) == key]
    return sorted(chosen, key=lambda run: model_order(run["model"]))


# ---- sections, written once, rendered as Markdown and as HTML ------------------------------------------------


def _sections(
    meta: dict, runs: list[dict], rows: list[dict], line: str, images: dict, timeline_runs: list[dict]
) -> list[tuple]:
    """A list of ``(kind, content)``: ("h1"|"h2"|"p"|"pre", text), ("table", (header, rows)), ("img", (path, alt))."""
    slo = meta["slo"]
    formats = weight_formats(meta)
    title = "Continuous vs dynamic batching on Triton: measured"
    if formats and formats != [BF16]:
        title += f" ({', '.join(formats)} weights)"
    s = [("h1", title), ("p", f"**Headline:** {line}")]
    if meta.get("max_num_seqs"):
        s.append(
            (
                "p",
                f"Every model runs at most {meta['max_num_seqs']} sequences at once"
                + _instances_text(meta.get("configs", {}), meta["max_num_seqs"])
                + ". The headline is taken at the highest load with no more users than that, where every request "
                "could be in the batch together; above it every model queues, and the tables below show by how much.",
            )
        )
    s.append(("p", _setup_text(meta, runs)))
    shared = _shared_text(runs)
    if shared:
        s.append(("p", shared))
    if meta.get("configs"):
        s += [
            ("h2", "Configurations served"),
            ("table", (CONFIG_HEADER, config_rows(meta["configs"], runs))),
            (
                "p",
                "Read from each model's config as the server served it (/v2/models/<model>/config). Triton's batcher: "
                "max_batch_size, preferred_batch_size, max_queue_delay and the instance count (each instance runs its "
                "own engine and KV pool); the engine's: max_num_seqs, max_num_batched_tokens, the KV-cache blocks "
                "(all instances together, as the engines reported them on the metrics port, else as configured per "
                "instance) and the weights (the engine parameter quantization, else the dtype).",
            ),
        ]
    for other in sorted({row["model"] for row in rows} - {CANDIDATE}, key=model_order):
        beside = comparison_rows(rows, other, CANDIDATE)
        if not beside:
            continue
        short = short_name(other)
        header = COMPARISON_HEADER[:-1] + [f"goodput req/s (cont. vs {short})"]
        text = BESIDE.get(other) or (
            f"{other} is {BASELINE} served with other batcher settings (the configuration table above): the dynamic "
            "batcher at the best settings found for it on this machine, or those given with --dynamic-variants."
        )
        s += [("h2", f"Continuous beside {short}, per load point"), ("p", text), ("table", (header, beside))]
    s += [
        ("h2", "Every load point"),
        ("table", ([c[0] for c in COLUMNS], table_rows(rows))),
        (
            "p",
            f"Goodput: requests (started in the measured window) with TTFT ≤ {slo['ttft_ms']:.0f} ms and TPOT ≤ "
            f"{slo['tpot_ms']:.0f} ms, per second. TTFT/TPOT/E2E are client-side (perf_counter in the Locust user). "
            "'mean batch' is sequences per forward step from the server's llm_batch_size histogram; 'mean waiting' "
            "adds the engine's queue and Triton's own queue in front of the model; 'cut off': requests still "
            "streaming when the drain limit ended the run (not failures; their TTFT counts, their E2E cannot); "
            "'steps/s' are forward steps per second; 'server CPU' is tritonserver with its Python-backend stubs and "
            "'loadgen CPU' the Locust process, both in percent of one core (100% = one core fully busy).",
        ),
    ]
    unmeasured = [row for row in rows if not is_measured(row)]
    if unmeasured:
        s.append(
            (
                "p",
                f"**Not measured:** a load point gives figures only when at least {MIN_REQUESTS} requests started "
                f"in a measurement window of at least {MIN_WINDOW_S:g} s; below that a rate or a percentile is "
                "noise, so the tables give none and the plots leave the point out: "
                + "; ".join(f"{row['model']} at {row['load']} ({row['not_measured']})" for row in unmeasured)
                + ".",
            )
        )
    s += [
        ("h2", "Throughput and latency against load"),
        ("img", (images["throughput"], "output tokens/s and requests/s against load")),
        ("img", (images["latency"], "TTFT and TPOT p50/p99 against load")),
        ("img", (images["e2e"], "end-to-end latency distribution")),
    ]
    if "batch" in images:
        load = timeline_runs[0]["load"]
        s += [
            ("h2", f"Why: batch size over time at {load}"),
            (
                "p",
                f"The pictures of {DESIGN_NOTE}, measured. "
                + (
                    "Static batching: the batcher waits for a full batch, which then runs to its longest member. "
                    if any(run["model"] == STATIC for run in timeline_runs)
                    else ""
                )
                + "Dynamic batching: Triton forms a batch, the batch runs to "
                "its longest member, and it shrinks as short answers finish; requests that arrive meanwhile wait in "
                "Triton's queue. Continuous batching: finished sequences leave and waiting ones join at every step, so "
                "the batch stays full while there is work.",
            ),
            ("p", _step_text(rows, timeline_runs)),
            ("p", _decision_costs(rows, timeline_runs)),
            ("img", (images["batch"], "sequences per forward step over time")),
            ("img", (images["batch_hist"], "forward steps by batch size")),
            (
                "p",
                "KV-cache blocks: under every policy the scheduler frees a sequence's blocks the step it finishes. "
                "A dynamic batch's KV use therefore falls as its members finish, and the freed blocks sit idle until "
                "the whole batch returns, because no waiting request can join it; the continuous engine hands them "
                "to a waiting request at the next step, so its KV use stays up while there is work.",
            ),
            ("img", (images["kv"], "KV-cache blocks in use over time")),
        ]
    s += [("h2", "The load generator"), ("p", _loadgen_text(rows))]
    errors = sorted({e for r in rows for e in r["errors"]})
    if errors:
        s += [("h2", "Failures seen"), ("pre", "\n".join(errors[:20]))]
    return s


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


def _step_text(rows: list[dict], timeline_runs: list[dict]) -> str:
    """What the server's own counters say at the plotted load: batch size times steps per second."""
    parts = []
    for run in timeline_runs:
        row = next(r for r in rows if r["model"] == run["model"] and r["load"] == run["load"])
        if row["steps_per_s"] and row["mean_batch_size"]:
            parts.append(
                f"{run['model']} ran {row['steps_per_s']:.1f} forward steps/s ({1000 / row['steps_per_s']:.0f} ms "
                f"each) with {row['mean_batch_size']:.2f} sequences per step, i.e. "
                f"{row['steps_per_s'] * row['mean_batch_size']:.0f} sequence-steps/s"
            )
    if not parts:
        return "The server exported no per-step batch sizes for this load."
    return f"Measured at {timeline_runs[0]['load']}: " + "; ".join(parts) + "."


def _decision_costs(rows: list[dict], timeline_runs: list[dict]) -> str:
    """One paragraph, from the measured numbers: what each row's way of deciding the batch costs it."""
    load = timeline_runs[0]["load"]
    at = {r["model"]: r for r in rows if r["load"] == load and is_measured(r)}
    measured = [r for r in rows if is_measured(r)]
    lowest = min(((r["arrival_rate"], r["users"]) for r in measured), default=None)
    low = {r["model"]: r for r in measured if (r["arrival_rate"], r["users"]) == lowest}
    cont = at.get(CANDIDATE)

    def said(row: dict) -> str:
        return (
            f"{fmt(row['mean_batch_size'], '{:.1f}')} sequences per step, "
            f"{fmt(row['mean_waiting_total'], '{:.1f}')} requests waiting, TTFT p99 {fmt(row['ttft_p99_ms'], 'ms')}, "
            f"{row['output_tok_per_s']:.0f} tok/s"
        )

    parts = []
    for model in sorted(at, key=model_order):
        row = at[model]
        if model == STATIC:
            wait = ""
            if model in low and CANDIDATE in low:
                wait = (
                    f" at {low[model]['load']} its TTFT p50 was {fmt(low[model]['ttft_p50_ms'], 'ms')} against "
                    f"{fmt(low[CANDIDATE]['ttft_p50_ms'], 'ms')} for continuous;"
                )
            parts.append(f"**static** waits to fill its batch:{wait} at {load}, {said(row)}")
        elif model == BASELINE or is_dynamic_variant(model):
            parts.append(
                f"**{short_name(model)}** runs each batch to its longest member while the next requests wait "
                f"in Triton's queue: at {load}, {said(row)}"
            )
        elif model == ITERATIVE:
            gap = row.get("mean_iteration_gap_ms")
            step = 1000 / row["steps_per_s"] if row.get("steps_per_s") else None
            cost = (
                f"{gap:.2f} ms per iteration between one step's end and the next execute()"
                + (f" ({100 * gap / step:.0f}% of a {step:.0f} ms step)" if step else "")
                if gap is not None
                else "a hand-back per iteration the metrics did not show"
            )
            parts.append(f"**iterative** pays Triton's scheduler at every step, {cost}: at {load}, {said(row)}")
        elif model == CANDIDATE:
            parts.append(
                f"**continuous** decides in its own loop, between steps, at no cost measured here: {said(row)}"
            )
    if not parts:
        return "No model was measured at the plotted load."
    text = "What each way of deciding the batch costs, measured: " + "; ".join(parts) + "."
    if cont is not None and ITERATIVE in at and at[ITERATIVE]["output_tok_per_s"]:
        close = at[ITERATIVE]["output_tok_per_s"] / cont["output_tok_per_s"] if cont["output_tok_per_s"] else None
        if close is not None:
            text += (
                f" Triton's iterative batching reached {close:.0%} of the continuous model's output tokens/s: "
                "iteration-level scheduling is what matters, whoever does it."
                if close >= 0.85
                else f" Triton's iterative batching reached {close:.0%} of the continuous model's output tokens/s."
            )
    return text


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


def _setup_text(meta: dict, runs: list[dict]) -> str:
    server = meta.get("server", {})
    parts = [
        _weights_text(meta),
        f"Workload {meta['workload']} (max_tokens with ignore_eos, so every model generates exactly the same tokens; "
        f"seed {meta.get('seed', 0)}).",
        f"Closed loop: N users each send the next request when the last one ends; "
        f"{meta.get('run_s', '?')} s per load point, the first {meta.get('ramp_s', '?')} s left out, "
        f"at most {meta.get('max_requests', '?')} requests each."
        if not meta.get("rates")
        else f"Open loop: Poisson arrivals at the given rate over {meta.get('users_for_rates')} users.",
        f"Protocol: {meta.get('protocol', 'grpc')}. Server: {server.get('url', '?')} "
        f"({'started by this run' if server.get('started_here') else 'already running'}), model folder "
        f"{server.get('model_folder', '?')}. Machine: {meta.get('machine', '?')}. Mode: {meta.get('mode', '?')}; "
        f"started {meta.get('started', '?')}.",
    ]
    loads = [run["loadavg_before"][0] for run in runs if run.get("loadavg_before")]
    if loads:
        parts.append(f"Load average (1 min) before each point: {min(loads):.1f}–{max(loads):.1f}.")
        cpus = meta.get("cpus") or 0
        if cpus and max(loads) > 0.75 * cpus:
            parts.append(
                f"**Warning:** other work was running on this {cpus}-CPU machine; absolute numbers are lower "
                "than on an idle one, and the models were measured under the same conditions only roughly."
            )
    return " ".join(parts)


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


def _loadgen_text(rows: list[dict]) -> str:
    cpu = [r["loadgen_cpu_mean"] for r in rows if r.get("loadgen_cpu_mean") is not None]
    peak = [r["loadgen_cpu_max"] for r in rows if r.get("loadgen_cpu_max") is not None]
    server = [r["server_cpu_mean"] for r in rows if r.get("server_cpu_mean") is not None]
    if not cpu:
        return "The load generator's CPU use was not measured."
    text = (
        f"Locust used {min(cpu):.0f}–{max(cpu):.0f}% of one core on average per load point (peak {max(peak):.0f}%), "
        "measured with psutil on its process every 0.5 s."
    )
    if server:
        text += (
            " The server (tritonserver and its Python-backend stubs) used "
            f"{min(server):.0f}–{max(server):.0f}% of one core (a server busy on two cores shows 200%)."
        )
    text += (
        " Locust's gevent loop is single-threaded: while it stays well below 100% of a core it is not what limits"
        " the measured throughput."
    )
    return text


def _markdown(sections: list[tuple]) -> str:
    out = []
    for kind, content in sections:
        if kind == "h1":
            out.append(f"# {content}\n")
        elif kind == "h2":
            out.append(f"## {content}\n")
        elif kind == "p":
            out.append(f"{content}\n")
        elif kind == "pre":
            out.append(f"```\n{content}\n```\n")
        elif kind == "table":
            header, rows = content
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(row) + " |" for row in rows]
            out.append("\n".join(lines) + "\n")
        elif kind == "img":
            path, alt = content
            out.append(f"![{alt}]({Path(path).name})\n")
    return "\n".join(out)


def _html(sections: list[tuple]) -> str:
    body = []
    for kind, content in sections:
        if kind in ("h1", "h2"):
            body.append(f"<{kind}>{html.escape(content)}</{kind}>")
        elif kind == "p":
            text = html.escape(content)
            while "**" in text:  # the one bit of Markdown the sections use
                text = text.replace("**", "<b>", 1).replace("**", "</b>", 1)
            body.append(f"<p>{text}</p>")
        elif kind == "pre":
            body.append(f"<pre>{html.escape(content)}</pre>")
        elif kind == "table":
            header, rows = content
            head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
            cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table>")
        elif kind == "img":
            path, alt = content
            data = base64.b64encode(Path(path).read_bytes()).decode()
            body.append(f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">')
    style = (
        "body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;line-height:1.45}"
        "table{border-collapse:collapse;font-size:13px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 7px;"
        "text-align:right}td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}img{max-width:100%}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>Continuous vs dynamic batching</title>"
        f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n"
    )


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
