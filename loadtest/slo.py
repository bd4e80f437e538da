"""Find the highest load each model sustains within a TTFT p99 and a TPOT p99 limit.

    python -m loadtest.slo                                      # defaults: TTFT p99 <= 2000 ms, TPOT p99 <= 100 ms
    python -m loadtest.slo --slo-ttft-ms 1000 --slo-tpot-ms 80 --users 1,2,4,8,16,32
    python -m loadtest.slo --url http://127.0.0.1:8000 --rates 0.5,1,2,4 # open loop: highest request rate
    python -m loadtest.slo --capacity                           # every model at its best seats: req/s within SLO
    python -m loadtest.slo --workload mixed --priorities both   # batch users beside interactive ones, per batcher

The tuning procedure of docs/batching.md (the design note on static, dynamic and continuous batching; its section on
settings and tuning), automated: for each model, step the load up (closed-loop users, or Poisson arrival rates) and
stop at the first load point whose p99 TTFT or p99 TPOT breaks its limit or that has failures. The answer is the
last load point that held. Every point is bounded like ``loadtest.compare``'s.

``--capacity`` is the comparison at capacity: every model at its best seats for this machine rather than the seats
they ship with (8 for Triton's batchers, 64 for ``llm_continuous``). The models that run over the paged cache step
by step (``llm_continuous``, ``llm_iterative``) get
as many sequences as the KV pool holds for the workload's mean request (``capacity_seats``: concurrency limited by
KV capacity, not by a fixed number of seats), the pool as a server reports it (``llm_kv_blocks_total``, read from a
first server of ``llm_continuous`` alone); ``llm_dynamic`` is served at each of ``--dynamic-variants`` (default
``CAPACITY_DYNAMIC``), since a run-to-completion batch holds no more than its seats whatever the pool. The ladder
is open loop (Poisson arrival rates) and the answer is the request rate each sustains within the SLO.

``--quantization q4_1`` (or ``int8``, ``bf16``) serves every model with that weight format: the engine parameter
``quantization`` set in a copy of the repository (``--capacity``'s copy, or one of its own), as ``make compare`` does.

``--workload mixed`` finds, per model, the highest batch load at which the interactive class still meets its
targets: ``--users`` counts the batch users beside ``--interactive-users`` interactive ones (``loadtest.slo_mixed``;
``--priorities on|both`` as in ``make compare``).

A point with too few requests in its measurement window (``loadtest.stats.not_measured``) is "not measured": it
neither holds nor breaks. The ladder goes on past it, unless the request budget (--max-requests) ran out, which a
higher load only spends sooner: then it stops there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import time
from pathlib import Path

from backend.contract import prometheus
from backend.contract.names import CONTINUOUS, DYNAMIC, ITERATIVE, KV_BLOCKS_TOTAL, MODELS
from backend.triton.launcher import config_text
from loadtest import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS, runner, slo_mixed
from loadtest.report import fmt
from loadtest.signals import exit_on_sigterm
from loadtest.stats import summarize
from loadtest.workloads import MIXED, WORKLOAD_NAMES, get_workload, make_request
from records.record import Column, Record

# The run-to-completion batch sizes tried in the capacity comparison (Triton's shipped 2 ms delay): one instance of 8,
# 16 or 32 seats (a bigger batch carries more requests at once, and makes each wait longer for the batch's longest
# member), and make compare's best configuration, two instances of 8.
CAPACITY_DYNAMIC = "1x8@2000,1x16@2000,1x32@2000,2x8@2000"
CAPACITY_RATES = "0.5,1,1.5,2,3,4,6,8"
# Seconds per rate: 0.5 req/s starts about stats.MIN_REQUESTS requests in the window (a sparser draw is "not
# measured", and the ladder goes on).
CAPACITY_DURATION_S = 60.0
MAX_CAPACITY_SEATS = 256  # the engine's queue bound (max_queue_size) and the histogram's top bucket
LADDER_USERS = "1,2,4,8,12,16,24,32"


def capacity_seats(kv_blocks: int, block_size: int, workload_name: str, length_scale: float = 1.0) -> dict:
    """How many sequences a KV pool of ``kv_blocks`` blocks of ``block_size`` tokens holds at once for the workload's
    mean request (prompt words, about one token each, plus its output), with what it was computed from."""
    workload = get_workload(workload_name, length_scale)
    requests = [make_request(workload, i) for i in range(2000)]
    mean_blocks = sum(-(-(r.num_prompt_words + r.max_tokens) // block_size) for r in requests) / len(requests)
    seats = max(1, min(MAX_CAPACITY_SEATS, int(kv_blocks // mean_blocks)))
    return {"seats": seats, "kv_blocks": int(kv_blocks), "block_size": block_size, "mean_blocks": mean_blocks}


def served_kv_pool(target: runner.Target, model: str, timeout_s: float = 30.0) -> tuple[int, int]:
    """``model``'s KV pool as the server runs it: (blocks, tokens per block). The blocks are what its engine
    allocated (``llm_kv_blocks_total`` on the metrics port, published once the model has loaded), the block size
    the ``block_size`` parameter of the config the server serves."""
    block_size = runner.served_parameter(runner.http_json(f"{target.http_url}/v2/models/{model}/config"), "block_size")
    if not (block_size or "").isdigit():
        raise RuntimeError(f"{model}'s config sets no block_size (got {block_size!r}); set the parameter to size "
                           "the KV pool in tokens")
    # NOTE: one value per instance, each its own engine and pool; a sequence lives in one of them. A model is
    # READY before its engine's loop has set its gauges (a moment later), so the metrics port is asked again.
    deadline = time.monotonic() + timeout_s
    while True:
        pools = [s.value for s in prometheus.read(target.metrics_url) or []
                 if s.name == KV_BLOCKS_TOTAL and s.labels.get("model") == model]
        if pools and min(pools) >= 1:
            return int(min(pools)), int(block_size)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{target.metrics_url} shows no {KV_BLOCKS_TOTAL} for {model} after {timeout_s:g} s")
        time.sleep(0.5)


def size_capacity(args: argparse.Namespace, out_dir: Path, say=print) -> dict:
    """:func:`capacity_seats` for ``llm_continuous``'s KV pool, read from a server that serves it alone (with the
    engine parameters of the command line), started here and stopped once read.

    NOTE: a server of its own before the measured one: the seats go into the measured models' configs, which
    Triton reads only when it loads them."""
    sizing = out_dir / "sizing"
    repository = runner.served_repository(args.model_repository, sizing / "model_repository", [CONTINUOUS], [],
                                          runner.engine_parameters(args))
    say(f"capacity: serving {CONTINUOUS} alone to read its KV pool (log: {sizing / 'tritonserver.log'}) ...")
    with runner.serve(repository, args.model, sizing / "tritonserver.log") as target:
        kv_blocks, block_size = served_kv_pool(target, CONTINUOUS)
    return capacity_seats(kv_blocks, block_size, args.workload, args.length_scale)


def capacity_repository(
    source: Path, dst: Path, seats: int, variants: list[runner.DynamicVariant], parameters: dict[str, str] | None = None
) -> Path:
    """The capacity comparison's models: llm_dynamic's ``variants``, and llm_iterative and llm_continuous with
    ``seats`` sequences (and, for llm_iterative, as many seats in Triton's sequence batcher); every one with the
    engine ``parameters`` given."""
    runner.served_repository(source, dst, [ITERATIVE, CONTINUOUS, *(v.name for v in variants)], variants, parameters)
    for model in (ITERATIVE, CONTINUOUS):
        with config_text.edit(dst / model / "config.pbtxt") as config:
            config_text.set_parameters(config, {"max_num_seqs": seats}, add_missing=False)
            if model == ITERATIVE:
                config_text.set_max_batch_size(config, seats)
                config_text.oldest_sequence_batching(config).max_candidate_sequences = seats
    return dst


def parse_args(argv=None) -> argparse.Namespace:
    p = runner.command_parser("python -m loadtest.slo", __doc__)
    interactive = slo_mixed.INTERACTIVE
    p.add_argument(
        "--slo-ttft-ms", type=float, default=None,
        help=f"TTFT p99 limit (default: {DEFAULT_SLO_TTFT_MS:g}; with --workload mixed, the {interactive.name} "
        f"class's, {interactive.ttft_ms:g})",
    )
    p.add_argument(
        "--slo-tpot-ms", type=float, default=None,
        help=f"TPOT p99 limit (default: {DEFAULT_SLO_TPOT_MS:g}; with --workload mixed, the {interactive.name} "
        f"class's, {interactive.tpot_ms:g})",
    )
    p.add_argument(
        "--models", default=None,
        help="default: llm_dynamic,llm_continuous; with --capacity or --workload mixed, all of them",
    )
    p.add_argument(
        "--users", default=None,
        help=f"closed-loop ladder (default: {LADDER_USERS}; with --workload mixed, batch users: "
        f"{slo_mixed.MIXED_USERS})",
    )
    p.add_argument("--rates", default=None, help="open-loop ladder of Poisson arrival rates (req/s) instead of --users")
    p.add_argument(
        "--max-users",
        type=int,
        default=None,
        help="users that carry the arrivals with --rates (default 64; with --capacity, the capacity seats plus 64)",
    )
    p.add_argument(
        "--capacity", action="store_true", help=f"every model at its best seats, ladder of rates {CAPACITY_RATES}"
    )
    p.add_argument(
        "--dynamic-variants",
        default=None,
        help=f"with --capacity: llm_dynamic's settings to try, INSTANCESxMAX_BATCH_SIZE@MAX_QUEUE_DELAY_US "
        f"(default: {CAPACITY_DYNAMIC})",
    )
    p.add_argument("--workload", default="long_tailed", choices=WORKLOAD_NAMES)
    runner.add_mixed_arguments(p)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"seconds of load per point (default 30; {CAPACITY_DURATION_S:g} with --capacity, "
        f"{slo_mixed.MIXED_DURATION_S:g} with --workload mixed)",
    )
    p.add_argument("--max-requests", type=int, default=1000, help="at most this many requests per point")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--out", type=Path, default=runner.REPO_ROOT / "reports")
    args = p.parse_args(argv)
    args.variants = []
    runner.check_mixed_arguments(p, args)
    mixed = args.workload == MIXED.name
    if mixed and args.capacity:
        p.error("--capacity sizes the seats for one kind of request; --workload mixed has two")
    defaults = {"slo_ttft_ms": DEFAULT_SLO_TTFT_MS, "slo_tpot_ms": DEFAULT_SLO_TPOT_MS, "users": LADDER_USERS}
    if mixed:  # the interactive class's targets, a ladder of batch users, and every batcher
        defaults = {"slo_ttft_ms": interactive.ttft_ms, "slo_tpot_ms": interactive.tpot_ms,
                    "users": slo_mixed.MIXED_USERS, "duration": slo_mixed.MIXED_DURATION_S, "models": ",".join(MODELS)}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quantization and args.url:
        p.error("--quantization sets the served copies' configs; with --url, set it in that server's configs instead")
    if args.capacity:
        if args.url:
            p.error("--capacity serves its own copy of the repository; it cannot use a running server (--url)")
        try:
            specs = args.dynamic_variants if args.dynamic_variants is not None else CAPACITY_DYNAMIC
            args.variants = [runner.DynamicVariant.parse(spec) for spec in specs.split(",") if spec.strip()]
        except ValueError as exc:
            p.error(str(exc))
        args.rates = args.rates or CAPACITY_RATES
        args.duration = args.duration or CAPACITY_DURATION_S
        args.models = args.models or ",".join([v.name for v in args.variants] + [ITERATIVE, CONTINUOUS])
    elif args.dynamic_variants is not None:
        p.error("--dynamic-variants belongs to --capacity here (make compare takes it too)")
    args.models = args.models or f"{DYNAMIC},{CONTINUOUS}"
    args.duration = args.duration or 30.0
    return args


def verdict(row: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> str | None:
    """None when a measured load point held; otherwise what broke."""
    broken = []
    if row["num_failed"]:
        broken.append(f"{row['num_failed']} failures")
    if row.get("missed"):  # a class too sparse for a p99 whose few requests missed their targets too often
        broken.append(row["missed"])
    elif row["ttft_p99_ms"] is None or row["ttft_p99_ms"] > slo_ttft_ms:
        broken.append(f"TTFT p99 {fmt(row['ttft_p99_ms'], 'ms')} > {slo_ttft_ms:g} ms")
    if row["tpot_p99_ms"] is not None and row["tpot_p99_ms"] > slo_tpot_ms:
        broken.append(f"TPOT p99 {fmt(row['tpot_p99_ms'], 'ms')} > {slo_tpot_ms:g} ms")
    return "; ".join(broken) or None


class WholeLoad:
    """How :func:`search` judges a load point of one kind of request: a row of every request that started in its
    window (``loadtest.stats.summarize``). ``loadtest.slo_mixed.InteractiveClass`` judges a mixed one."""

    def __init__(self, plan: runner.Plan) -> None:
        self.plan = plan

    def row(self, run: dict) -> dict:
        return summarize(run, self.plan.slo_ttft_ms, self.plan.slo_tpot_ms)

    @staticmethod
    def figures(row: dict) -> str:
        """A measured point as the ladder's progress line says it."""
        return (
            f"TTFT p99 {fmt(row['ttft_p99_ms'], 'ms')}, TPOT p99 {fmt(row['tpot_p99_ms'], 'ms')}, "
            f"{row['output_tok_per_s']:.0f} tok/s, {row['num_failed']} failures"
        )

    @staticmethod
    def best_figures(row: dict) -> str:
        """The point that held, as the outcome line says it."""
        return (
            f"{row['output_tok_per_s']:.0f} tok/s, {row['req_per_s']:.2f} req/s, "
            f"TTFT p99 {fmt(row['ttft_p99_ms'], 'ms')}, TPOT p99 {fmt(row['tpot_p99_ms'], 'ms')}"
        )


def search(
    target, model: str, points: list[runner.LoadPoint], plan: runner.Plan, out_dir: Path, say=print, judge=None
) -> dict:
    """Step up through ``points`` until one breaks the SLO; return the best that held, the first that broke and
    those not measured. ``judge`` (a :class:`WholeLoad` of ``plan`` by default) makes each run a row that
    :func:`verdict` reads."""
    judge = judge or WholeLoad(plan)
    best, broke, unmeasured, rows = None, None, [], []
    for point in points:
        run = runner.run_load_point(target, model, point, plan, out_dir)
        row = judge.row(run)
        rows.append(row)
        if row["not_measured"]:
            say(f"  {model} at {point.label}: not measured: {row['not_measured']}")
            unmeasured.append({"load": point.label, "why": row["not_measured"], "budget_spent": row["budget_spent"]})
            if row["budget_spent"]:
                break
            continue
        why = verdict(row, plan.slo_ttft_ms, plan.slo_tpot_ms)
        outcome = "ok" if why is None else f"BROKEN: {why}"
        say(f"  {model} at {point.label}: {judge.figures(row)} -> {outcome}")
        if why is not None:
            broke = {"load": point.label, "why": why}
            break
        best = row
    return {"model": model, "best": best, "first_violation": broke, "not_measured": unmeasured, "rows": rows}


def outcome_line(result: dict, best_figures=WholeLoad.best_figures) -> str:
    """One model's answer: the highest load that held, where the ladder broke or stopped, and what went unmeasured.
    ``best_figures`` says the figures of the point that held (its judge's)."""
    best, broke, unmeasured = result["best"], result["first_violation"], result.get("not_measured", [])
    if best is not None:
        parts = [f"{best['load']} ({best_figures(best)})"]
    else:
        parts = ["none of the ladder" if broke else "no load point measured"]
    if broke:
        parts.append(f"broke at {broke['load']}: {broke['why']}")
    elif best is not None:
        parts.append("every measured point held" if unmeasured else "the whole ladder held")
    parts += [f"not measured at {point['load']}: {point['why']}" for point in unmeasured]
    if any(point["budget_spent"] for point in unmeasured):
        parts[-1] += " (raise --max-requests to measure higher loads)"
    name = result["model"] + {None: "", False: ", priorities off", True: ", priorities on"}[result.get("priorities")]
    return f"{name:16s} " + "; ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    mixed = args.workload == MIXED.name
    plan = runner.Plan(
        workload=args.workload,
        length_scale=args.length_scale,
        run_s=args.duration,
        ramp_s=min(5.0, args.duration / 4),
        max_requests=args.max_requests,
        protocol=args.protocol,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        interactive_users=args.interactive_users if mixed else 0,
    )
    judge = slo_mixed.InteractiveClass if mixed else WholeLoad
    models = [m for m in args.models.split(",") if m]
    out_dir = args.out / ("slo-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    say = lambda msg: print(f"[slo {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    variant = " --capacity" if args.capacity else " --workload mixed" if mixed else ""
    record = Record.start("make slo" + variant, vars(args))
    capacity = None
    if args.capacity:
        try:
            capacity = size_capacity(args, out_dir, say)
        except Exception as exc:
            print(f"slo: error: {exc}", file=sys.stderr)
            return 1
        say(
            f"capacity: {capacity['kv_blocks']} KV blocks of {capacity['block_size']} tokens, "
            f"{capacity['mean_blocks']:.1f} per mean request: {capacity['seats']} sequences for "
            f"{ITERATIVE} and {CONTINUOUS}; {DYNAMIC} as {', '.join(v.name for v in args.variants)}"
        )
        args.model_repository = capacity_repository(
            args.model_repository, out_dir / "model_repository", capacity["seats"], args.variants,
            runner.engine_parameters(args),
        )
    else:
        args.model_repository = runner.repository_to_serve(args, out_dir, models)
    max_users = args.max_users or (capacity["seats"] + 64 if capacity else 64)
    if args.rates:
        points = [runner.LoadPoint(max_users, float(r)) for r in args.rates.split(",")]
    else:
        points = [runner.LoadPoint(int(u)) for u in args.users.split(",")]
    passes = runner.PRIORITY_PASSES[args.priorities]
    say(
        f"SLO: TTFT p99 <= {args.slo_ttft_ms:g} ms, TPOT p99 <= {args.slo_tpot_ms:g} ms; {', '.join(models)}; "
        f"ladder {', '.join(p.label for p in points)}; {args.workload} workload"
        + (f" ({args.interactive_users} interactive users beside the ladder's batch users; priorities "
           f"{args.priorities})" if mixed else "")
        + f"; {args.duration:g} s per point; "
        + (f"{args.quantization} weights" if args.quantization else "weights as configured")
    )
    try:
        with runner.open_target(args, out_dir / "tritonserver.log", say=say) as target:
            configs = runner.check_models(target, models)
            for model in models:
                runner.warm_up(target, model)
            results = []
            # NOTE: one pass after the other, as make compare runs them: a pass's ladders on one quiet stretch.
            for priorities in passes:
                pass_plan = dataclasses.replace(plan, priorities=priorities)
                for model in models:
                    if mixed:
                        say(f"{model}, priorities {'on' if priorities else 'off'}:")
                    result = search(target, model, points, pass_plan, out_dir, say, judge(pass_plan))
                    results.append({**result, "priorities": priorities} if mixed else result)
    except Exception as exc:
        print(f"slo: error: {exc}", file=sys.stderr)
        return 1
    for result in results:
        result["config"] = runner.batcher_settings(configs[result["model"]])
    summary = {"plan": dataclasses.asdict(plan), "capacity": capacity, "quantization": args.quantization,
               "results": results}
    if mixed:
        summary["classes"] = slo_mixed.classes(plan.slo_ttft_ms, plan.slo_tpot_ms)
    (out_dir / "slo.json").write_text(json.dumps(summary, indent=1))
    record.settings.update({"capacity": capacity, "configs": {r["model"]: r["config"] for r in results}})
    if mixed:
        table = record.add_table("mixed", slo_mixed.MIXED_COLUMNS, slo_mixed.mixed_rows(results),
                                 title=slo_mixed.mixed_title(plan))
        record.notes.append(slo_mixed.mixed_title(plan))
    else:
        record.add_table("capacity", CAPACITY_COLUMNS, capacity_rows(results),
                         title=f"within TTFT p99 <= {args.slo_ttft_ms:g} ms and TPOT p99 <= {args.slo_tpot_ms:g} ms")
        record.notes.append(capacity_table(results, args.slo_ttft_ms, args.slo_tpot_ms).splitlines()[-1])
    record.write(out_dir / "record.json")
    print()
    if mixed:
        print(f"Highest batch load with {slo_mixed.mixed_title(plan)}:")
    else:
        print(f"Highest load within TTFT p99 <= {args.slo_ttft_ms:g} ms and TPOT p99 <= {args.slo_tpot_ms:g} ms:")
    for result in results:
        print(f"  {outcome_line(result, judge.best_figures)}")
    if capacity or mixed:
        print()
        print(table.markdown() if mixed else capacity_table(results, args.slo_ttft_ms, args.slo_tpot_ms))
    print(f"details: {out_dir / 'slo.json'}; the run's record: {out_dir / 'record.json'}")
    return 0


def seats_text(config: dict) -> str:
    instances, seats = config.get("instance_count") or 1, config.get("max_num_seqs") or "?"
    return f"{instances} x {seats}" if instances > 1 else f"{seats}"


CAPACITY_COLUMNS = [
    Column("model"), Column("seats"), Column("sustained_req_per_s", "sustained req/s", "{:.2f}"),
    Column("offered", "at offered load"), Column("output_tok_per_s", "output tok/s there", "{:.0f}"),
    Column("ttft_p99_ms", "TTFT p99", "ms"), Column("tpot_p99_ms", "TPOT p99", "ms"),
    Column("broke", "first load that broke"),
]


def capacity_rows(results: list[dict]) -> list[dict]:
    """Per model: its seats and the highest load it sustained within the SLO (figures there), and the first that
    broke it; the rows of the printed table and of the run's record."""
    rows = []
    for result in results:
        best, broke = result["best"] or {}, result["first_violation"]
        rows.append({
            "model": result["model"], "seats": seats_text(result.get("config", {})),
            "sustained_req_per_s": best.get("req_per_s"), "offered": best.get("load", "none of the ladder"),
            "output_tok_per_s": best.get("output_tok_per_s"), "ttft_p99_ms": best.get("ttft_p99_ms"),
            "tpot_p99_ms": best.get("tpot_p99_ms"), "broke": f"{broke['load']}: {broke['why']}" if broke else None,
        })
    return rows


def capacity_table(results: list[dict], slo_ttft_ms: float, slo_tpot_ms: float) -> str:
    """The capacity comparison as a Markdown table: per model, its seats and the highest request rate it sustained
    within the SLO; then the continuous model beside the best dynamic configuration."""
    rows = capacity_rows(results)
    headers = [c.header for c in CAPACITY_COLUMNS]
    headers[2] += f" (TTFT p99 <= {slo_ttft_ms:g} ms, TPOT p99 <= {slo_tpot_ms:g} ms)"
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c.cell(row) for c in CAPACITY_COLUMNS) + " |" for row in rows]
    sustained = {row["model"]: row["sustained_req_per_s"] or 0.0 for row in rows}
    dynamic = {m: v for m, v in sustained.items() if m == DYNAMIC or m.startswith(DYNAMIC + "_")}
    if dynamic and CONTINUOUS in sustained:
        best_dynamic = max(dynamic, key=dynamic.get)
        lines.append("")
        if dynamic[best_dynamic]:
            ratio = sustained[CONTINUOUS] / dynamic[best_dynamic]
            said = f"the best dynamic configuration ({best_dynamic}) {dynamic[best_dynamic]:.2f}" + (
                f": {ratio:.1f}x." if ratio else ".")
        else:
            lowest = next((r["rows"][0]["load"] for r in results if r["rows"]), "?")
            said = f"no dynamic configuration held even the ladder's lowest load ({lowest})."
        lines.append(f"{CONTINUOUS} sustains {sustained[CONTINUOUS]:.2f} req/s within the SLO; {said}")
    return "\n".join(lines)


if __name__ == "__main__":
    exit_on_sigterm()  # the servers it started are stopped, not left running
    sys.exit(main())
