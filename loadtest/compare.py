"""Drive the same Locust workload against each model at a sweep of loads, and write the comparison report.

    python -m loadtest.compare                       # ~10 min: long-tailed workload at 1, 4, 8, 16 users
    python -m loadtest.compare --quick               # ~2-3 min: 2 and 8 users, shorter outputs
    python -m loadtest.compare --smoke               # ~1 min: one load point, tiny outputs (CI)
    python -m loadtest.compare --url http://127.0.0.1:8000 --models llm_dynamic,llm_continuous --users 4,8
    python -m loadtest.compare --quick --models llm_dynamic --dynamic-variants 2x4@2000,1x8@50000

Without ``--url`` it starts its own tritonserver on ``model_repository/`` (free 127.0.0.1 ports) through the
launcher. For each model and load point it runs headless Locust (a subprocess; its CPU use is measured), samples
the metrics port every 0.5 s, and writes ``reports/<timestamp>/``: ``results.json`` (everything measured),
``report.md``, a self-contained ``report.html``, PNG plots, and Locust's own CSVs and logs in ``locust/``. While it
runs, it serves the live view (``loadtest/live.py``: every model's batch, queues, KV blocks and tokens/s, and the
clients' TTFT and TPOT) on a free 127.0.0.1 port, and prints its URL first.

By default the four models are compared (static, dynamic, Triton's iterative and the model's own continuous
batching), plus ``llm_dynamic`` at the best settings found for it on the development machine (``BEST_DYNAMIC``), so
the dynamic batcher is shown at its best beside its shipped configuration. ``--dynamic-variants`` gives other
settings: each ``INSTANCESxMAX_BATCH_SIZE@MAX_QUEUE_DELAY_US`` is served as a copy of ``llm_dynamic`` named
``llm_dynamic_<I>x<B>_<D>us`` (the compared models are copied, with the launcher's ``copy_model_repository``, into
the report's ``model_repository/``, and that copy is served). ``--quantization q4_1`` (or ``int8``, ``bf16``) serves
every model with that weight format, the engine parameter ``quantization`` set in the same copies. The report's
configuration table states every batcher setting and the weights of each model as the server served it.

Goodput counts the requests with TTFT <= --slo-ttft-ms (default 2000) and TPOT <= --slo-tpot-ms (default 100);
``python -m loadtest.slo`` holds a load point's p99s to the same limits.

``--workload mixed`` puts two kinds of traffic on each model: ``--interactive-users`` interactive users (short
requests, with TTFT and TPOT targets) at every load point, beside the point's users, who are batch users (long
prompts and answers, no target). ``--priorities on`` sends each class at its priority level (interactive 1, batch 3)
and serves copies of the models with the engine's ``scheduling_policy`` priority; ``--priorities both`` runs every
load point without priorities, then with them. The report adds a table per model: each class's tokens/s, TTFT and
TPOT p50/p99, and the share of interactive requests within their targets (docs/comparison.md, "The mixed workload").

``--peer vllm`` (off by default) adds vLLM itself as rows: its CPU build's OpenAI server (``loadtest/peer_rows.py``;
``make vllm-venv`` builds its environment, ``.venv-vllm``), one server per seat count of ``--peer-seats`` (default
``default,8``: vLLM's own max_num_seqs as the row ``vllm``, and 8, Triton's batchers' seats, as ``vllm_8seats``), each
driven by the same Locust workload at the same load points. In that mode the Triton models are loaded through their
OpenAI frontend too (``--protocol openai``, which it implies), so every row pays the same protocol. Every server is
started before the first load point and stays up to the last, and the rows take turns at each load point: one server
is under load at a time, the others idle (the report says what they used meanwhile). The report states vLLM's
settings (seats, KV cache space, threads binding, version) beside the Triton models' configurations.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from backend.contract.names import DYNAMIC, MODELS
from backend.contract.settings import DEFAULT_MODEL
from loadtest import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS, live, peer_rows, report, runner
from loadtest.signals import exit_on_sigterm
from loadtest.stats import LoadPointRow
from loadtest.workloads import WORKLOAD_NAMES, MixedWorkload, get_workload
from records.record import Record

# llm_dynamic at its best on the development machine (2 cores): two instances of 8 seats, the shipped 2 ms delay. Of
# 1x8@2000 (shipped), 2x4@2000, 2x8@2000, 1x8@50000 and 1x16@2000 at 8 and 16 users (`make compare ARGS="--models
# llm_dynamic --dynamic-variants 2x4@2000,2x8@2000,1x8@50000,1x16@2000 --users 8,16"`), it had the most output
# tokens/s and goodput at both: docs/comparison.md, "The dynamic batcher at its best".
BEST_DYNAMIC = "2x8@2000"

# Per mode: the sweep and how long each point runs (then at most stop_timeout_s of drain). The shorter modes scale
# prompt and output lengths down together so that the long tail still fits in their shorter points. Each window is
# long enough for the fewest users to finish well over stats.MIN_REQUESTS requests on a 2-core machine.
MODES = {
    "default": {"users": [1, 4, 8, 16], "plan": runner.Plan(run_s=45, ramp_s=5, max_requests=2000, stop_timeout_s=60)},
    "quick": {"users": [2, 8],
              "plan": runner.Plan(length_scale=0.5, run_s=20, ramp_s=3, max_requests=600, stop_timeout_s=45)},
    "smoke": {"users": [4],
              "plan": runner.Plan(length_scale=0.125, run_s=15, ramp_s=1, max_requests=200, stop_timeout_s=20)},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = runner.command_parser("python -m loadtest.compare", __doc__)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick", help="~2-3 minutes")
    mode.add_argument("--smoke", action="store_const", dest="mode", const="smoke", help="~1 minute, for CI")
    p.add_argument(
        "--models",
        default=None,
        help="Triton models to compare (default: " + ",".join(MODELS) + ", with the --dynamic-variants after "
        f"{DYNAMIC})",
    )
    p.add_argument("--users", default=None, help="comma-separated concurrencies (closed loop); default per mode")
    p.add_argument(
        "--rates", default=None, help="comma-separated Poisson arrival rates (req/s) instead of --users: open loop"
    )
    p.add_argument(
        "--max-users", type=int, default=64, help="users that carry the arrivals with --rates (default: %(default)s)"
    )
    p.add_argument("--workload", default="long_tailed", choices=WORKLOAD_NAMES)
    runner.add_mixed_arguments(p)
    p.add_argument(
        "--length-scale",
        type=float,
        default=None,
        help="multiply prompt and output lengths (default per mode: 1, 0.5, 0.125)",
    )
    p.add_argument(
        "--duration", type=float, default=None, help="seconds of load per point (default per mode: 45, 20, 15)"
    )
    p.add_argument("--max-requests", type=int, default=None, help="at most this many requests per point")
    p.add_argument("--protocol", choices=["grpc", "http", "openai"], default=None,
                   help="GrpcStreamUser, HttpStreamUser or OpenAIStreamUser (the OpenAI frontend, started beside a "
                   "server started here; default: grpc, openai with --peer)")
    p.add_argument("--peer", choices=peer_rows.PEERS, default=None,
                   help="also load vLLM's own OpenAI server, a row per --peer-seats, every row over the OpenAI API")
    p.add_argument("--peer-seats", type=peer_rows.seat_counts, default=peer_rows.DEFAULT_SEATS,
                   help="--peer vllm: vLLM's max_num_seqs, a server and a row each: default (vLLM's own) or a number "
                   "(default: %(default)s)")
    p.add_argument("--vllm-venv", type=Path, default=peer_rows.VENV,
                   help="--peer vllm: vLLM's environment (make vllm-venv; default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO_TTFT_MS)
    p.add_argument("--slo-tpot-ms", type=float, default=DEFAULT_SLO_TPOT_MS)
    p.add_argument("--out", type=Path, default=runner.REPO_ROOT / "reports", help="reports go in OUT/<timestamp>/")
    p.add_argument("--live-port", type=int, default=0, help="the live view's port on 127.0.0.1 (default: a free one)")
    p.add_argument(
        "--dynamic-variants",
        default=None,
        help="comma-separated llm_dynamic settings to serve beside it, each "
        "INSTANCESxMAX_BATCH_SIZE@MAX_QUEUE_DELAY_US "
        f"(default: {BEST_DYNAMIC}, the best found here; with --url: none; '' for none)",
    )
    args = p.parse_args(argv)
    args.mode = args.mode or "default"
    if args.dynamic_variants is None:
        args.dynamic_variants = "" if args.url else BEST_DYNAMIC
    try:
        args.variants = [runner.DynamicVariant.parse(spec) for spec in args.dynamic_variants.split(",") if spec.strip()]
    except ValueError as exc:
        p.error(str(exc))
    if args.variants and args.url:
        p.error("--dynamic-variants serve a copy of the repository; with --url, serve them on that server instead")
    if args.quantization and args.url:
        p.error("--quantization sets the served copies' configs; with --url, set it in that server's configs instead")
    runner.check_mixed_arguments(p, args)
    check_peer_arguments(p, args)
    models = list(MODELS) if args.models is None else [m for m in args.models.split(",") if m]
    if args.variants and DYNAMIC not in models:
        p.error(f"--dynamic-variants are compared beside {DYNAMIC}: put it among --models")
    args.models = ",".join(with_variants(models, args.variants))
    return args


def check_peer_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Settle ``--protocol`` (openai with ``--peer``, else grpc) and ``args.peer_rows``; refuse what cannot be
    compared with vLLM on the same terms, and a missing vLLM environment, before anything starts."""
    args.peer_rows = peer_rows.peer_rows(args.peer_seats) if args.peer else []
    if not args.peer:
        args.protocol = args.protocol or "grpc"
        return
    if args.protocol not in (None, "openai"):
        parser.error(f"--peer {args.peer} runs every row over the OpenAI API, so that each pays the same protocol: "
                     f"leave out --protocol {args.protocol} (or give --protocol openai)")
    args.protocol = "openai"
    if args.quantization not in (None, runner.BF16):
        parser.error(f"--peer {args.peer} serves the model in bfloat16: --quantization {args.quantization} would "
                     "compare other weights")
    if args.priorities != "off":
        parser.error(f"--peer {args.peer} serves vLLM with its first-come-first-served policy: leave out --priorities")
    problem = peer_rows.missing_venv(args.vllm_venv)
    if problem:
        parser.error(problem)


def with_variants(models: list[str], variants: list[runner.DynamicVariant]) -> list[str]:
    """``models`` with the dynamic variants right after llm_dynamic (those not named already)."""
    if DYNAMIC not in models:
        return list(models)
    at = models.index(DYNAMIC) + 1
    return models[:at] + [v.name for v in variants if v.name not in models] + models[at:]


def make_plan(args) -> tuple[runner.Plan, list[runner.LoadPoint]]:
    mode = MODES[args.mode]
    plan = dataclasses.replace(
        mode["plan"],
        workload=args.workload,
        protocol=args.protocol,
        seed=args.seed,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        interactive_users=args.interactive_users if args.workload == "mixed" else 0,
    )
    if args.length_scale is not None:
        plan.length_scale = args.length_scale
    if args.duration is not None:
        plan.run_s = args.duration
        plan.ramp_s = min(plan.ramp_s, args.duration / 4)
    if args.max_requests is not None:
        plan.max_requests = args.max_requests
    if args.rates:
        points = [runner.LoadPoint(args.max_users, float(r)) for r in args.rates.split(",")]
    else:
        users = [int(u) for u in args.users.split(",")] if args.users else mode["users"]
        points = [runner.LoadPoint(u) for u in users]
    return plan, points


def live_view(models: list[str], plan: runner.Plan, out_dir: Path) -> live.LiveView:
    """The live page's data: the compared models from the metrics port, the clients' latencies from the records
    files of the Locust runs (``out_dir/locust/``)."""
    view = live.LiveView(live.LatencyBook(plan.slo_ttft_ms, plan.slo_tpot_ms), models=models)
    view.followers.append(live.RecordsFollower(out_dir / "locust"))
    return view


def machine() -> str:
    system = f"{platform.system()} {platform.release()}"
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {system}, Python {platform.python_version()}"


def log(message: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {message}", flush=True)


def load_order(points: list[runner.LoadPoint], passes: tuple[bool, ...], rows: list[str]) -> list[tuple]:
    """``(point, priorities, row)`` in the order they run: at each load point and pass, every row in turn (the
    Triton models, then vLLM's rows).

    NOTE: rows alternate at each load point (not one whole sweep after the other), so that anything else happening
    on the machine meanwhile affects them all about equally; so do the passes without and with priorities."""
    return list(itertools.product(points, passes, rows))


def sweep(
    target: runner.Target,
    models: list[str],
    points: list[runner.LoadPoint],
    plan: runner.Plan,
    out_dir: Path,
    meta: dict,
    passes: tuple[bool, ...] = (False,),
    peers: dict[str, runner.Target] | None = None,
) -> list[dict]:
    """Every row at every load point: ``models`` on the Triton ``target``, and vLLM's rows (``peers``: row -> its
    server), each Locust run alone; the servers not under load are sampled as idle."""
    peers = peers or {}
    configs = runner.check_models(target, models)
    meta["max_num_seqs"] = next((n for n in map(runner.max_num_seqs, configs.values()) if n), None)
    meta["configs"] = {model: runner.batcher_settings(config) for model, config in configs.items()}
    concurrency = meta["max_num_seqs"] or 8
    for model in models:
        log(f"warming up {model} ({runner.warm_up(target, model, concurrency=concurrency):.1f} s)")
    for name, peer in peers.items():
        log(f"warming up {name} ({peer_rows.warm_up(peer, name, concurrency=concurrency):.1f} s)")
    targets = {**{model: target for model in models}, **peers}
    servers = {"tritonserver": target.server_pid, **{name: peer.server_pid for name, peer in peers.items()}}
    order = load_order(points, passes, list(targets))
    runs = []
    for point, priorities, model in order:
        with_priorities = " with priorities" if priorities else ""
        log(f"[{len(runs) + 1}/{len(order)}] {model} at {point.label}{with_priorities}: {plan.run_s:g} s of load, "
            "then the drain ...")
        t0 = time.perf_counter()
        idle = {name: pid for name, pid in servers.items() if pid and pid != targets[model].server_pid}
        run = runner.run_load_point(targets[model], model, point, dataclasses.replace(plan, priorities=priorities),
                                    out_dir, idle_pids=idle)
        runs.append(run)
        row = LoadPointRow.summarize(run, plan.slo_ttft_ms, plan.slo_tpot_ms)
        if not row.measured:
            log(f"    not measured: {row.not_measured} ({time.perf_counter() - t0:.0f} s)")
            continue
        log(
            f"    {row.num_requests} requests, {row.req_per_s:.2f} req/s, "
            f"{row.output_tok_per_s:.0f} tok/s, "
            f"TTFT p99 {report.fmt(row.ttft_p99_ms, 'ms')}, TPOT p99 {report.fmt(row.tpot_p99_ms, 'ms')}, "
            f"failures {row.num_failed}, loadgen CPU {report.fmt(row.loadgen_cpu_mean, '{:.0f}%')} "
            f"({time.perf_counter() - t0:.0f} s)"
        )
    return runs


@contextlib.contextmanager
def serve_peers(args: argparse.Namespace, target: runner.Target,
                out_dir: Path) -> Iterator[tuple[dict[str, runner.Target], dict[str, dict]]]:
    """vLLM's rows (``args.peer_rows``) served on the model folder the Triton models serve, each ready: row -> its
    target, row -> its settings; every server stopped on exit. NOTE: started one after the other, as each start
    compiles the model on every core."""
    model_folder = runner.REPO_ROOT / (args.model or target.model_folder or DEFAULT_MODEL)
    targets, settings = {}, {}
    with contextlib.ExitStack() as servers:
        for row in args.peer_rows:
            targets[row.name], settings[row.name] = servers.enter_context(peer_rows.serve(
                row, model_folder, args.vllm_venv, out_dir / f"{row.name}.log", target.metrics_url, say=log))
        yield targets, settings


def write_record(record: Record, built: dict, meta: dict, out_dir: Path) -> Path:
    """``record.json``: the run's provenance, settings and every load point's figures, the baseline's rows beside
    the others' (keep it in records/runs/ to put its table in the docs)."""
    columns = report.record_columns()
    keys = {c.key for c in columns}
    record.settings.update({"workload": meta["workload"], "configs": meta.get("configs"), "slo": meta["slo"],
                            **({"peers": meta["peers"]} if meta.get("peers") else {})})
    record.add_table("load_points", columns, [{k: v for k, v in row.to_json().items() if k in keys}
                                              for row in built["rows"]],
                     title="Every model at every load point")
    if built.get("class_rows"):
        record.add_table("classes", report.class_record_columns(), report.class_record_rows(built["class_rows"]),
                         title="Every class of the mixed workload, per model, load point and priorities")
    record.notes.append(built["headline"])
    return record.write(out_dir / "record.json")


def main(argv=None) -> int:
    args = parse_args(argv)
    plan, points = make_plan(args)
    models = [m for m in args.models.split(",") if m]
    out_dir = args.out / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = get_workload(plan.workload, plan.length_scale)
    record = Record.start(f"make compare{' --' + args.mode if args.mode != 'default' else ''}", vars(args))
    meta = {
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "mode": args.mode,
        "workload": workload.describe(),
        "length_scale": plan.length_scale,
        "protocol": plan.protocol,
        "seed": plan.seed,
        "run_s": plan.run_s,
        "ramp_s": plan.ramp_s,
        "max_requests": plan.max_requests,
        "rates": args.rates,
        "users_for_rates": args.max_users if args.rates else None,
        "slo": {"ttft_ms": plan.slo_ttft_ms, "tpot_ms": plan.slo_tpot_ms},
        "machine": machine(),
        "cpus": os.cpu_count(),
        "models": models,
        "quantization": args.quantization,
    }
    if isinstance(workload, MixedWorkload):
        meta.update(classes=[c.describe() for c in workload.classes], interactive_users=plan.interactive_users,
                    priorities=args.priorities)
    rows = models + [row.name for row in args.peer_rows]
    loads = ", ".join(p.label for p in points)
    weights = f"{args.quantization} weights" if args.quantization else "weights as configured"
    log(f"{args.mode} run: {', '.join(rows)} at {loads}; {workload.describe()}; {weights}; report in {out_dir}")
    started = time.perf_counter()
    page = live.LivePage(live_view(rows, plan, out_dir), args.live_port).start()
    log(f"watch every model's batch, queues and KV blocks live at {page.url}")
    try:
        if not args.url:  # NOTE: a running server serves its own configs (--priorities: its scheduling_policy)
            args.model_repository = runner.repository_to_serve(args, out_dir, models)
        with runner.open_target(args, out_dir / "tritonserver.log", say=log) as target, \
                serve_peers(args, target, out_dir) as (peers, peer_settings):
            page.view.metrics_url = target.metrics_url
            meta["server"] = {
                "url": target.http_url,
                "started_here": target.server is not None,
                "model_folder": target.model_folder or "(the server's own)",
            }
            if peers:
                meta["peers"] = peer_settings
            runs = sweep(target, models, points, plan, out_dir, meta, runner.PRIORITY_PASSES[args.priorities],
                         peers)
    except Exception as exc:  # a clear message, not a traceback: the cause is almost always the server or a model
        print(f"compare: error: {exc}", file=sys.stderr)
        if not any(out_dir.iterdir()):
            out_dir.rmdir()
        return 1
    finally:
        page.stop()
    meta["duration_s"] = round(time.perf_counter() - started, 1)
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}))
    built = report.build({"meta": meta, "runs": runs}, out_dir)
    write_record(record, built, meta, out_dir)
    print()
    print(Path(built["md"]).read_text().split("## Every load point")[0].strip())
    print()
    log(f"done in {meta['duration_s']:.0f} s. Report: {built['html']}")
    print(built["headline"])
    return 0


if __name__ == "__main__":
    exit_on_sigterm()  # the servers it started are stopped, not left running
    sys.exit(main())
