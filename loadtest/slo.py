"""Find the highest load each model sustains within a TTFT p99 and a TPOT p99 limit.

    python -m loadtest.slo                                      # defaults: TTFT p99 <= 2000 ms, TPOT p99 <= 100 ms
    python -m loadtest.slo --slo-ttft-ms 1000 --slo-tpot-ms 80 --users 1,2,4,8,16,32
    python -m loadtest.slo --url http://127.0.0.1:8000 --rates 0.5,1,2,4 # open loop: highest request rate

The tuning procedure of docs/batching.md (the design note on static, dynamic and continuous batching; its section on
settings and tuning), automated: for each model, step the load up (closed-loop users, or Poisson arrival rates) and
stop at the first load point whose p99 TTFT or p99 TPOT breaks its limit or that has failures. The answer is the
last load point that held. Every point is bounded like ``loadtest.compare``'s.

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

from loadtest import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS
from loadtest.report import fmt
from loadtest.runner import (
    REPO_ROOT,
    LoadPoint,
    Plan,
    check_models,
    command_parser,
    open_target,
    run_load_point,
    warm_up,
)
from loadtest.stats import summarize
from loadtest.workloads import WORKLOADS


def parse_args(argv=None) -> argparse.Namespace:
    p = command_parser("python -m loadtest.slo", __doc__)
    p.add_argument(
        "--slo-ttft-ms", type=float, default=DEFAULT_SLO_TTFT_MS, help="TTFT p99 limit (default: %(default)s)"
    )
    p.add_argument(
        "--slo-tpot-ms", type=float, default=DEFAULT_SLO_TPOT_MS, help="TPOT p99 limit (default: %(default)s)"
    )
    p.add_argument("--models", default="llm_dynamic,llm_continuous")
    p.add_argument("--users", default="1,2,4,8,12,16,24,32", help="closed-loop ladder (default: %(default)s)")
    p.add_argument("--rates", default=None, help="open-loop ladder of Poisson arrival rates (req/s) instead of --users")
    p.add_argument("--max-users", type=int, default=64, help="users that carry the arrivals with --rates")
    p.add_argument("--workload", default="long_tailed", choices=sorted(WORKLOADS))
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per point (default: %(default)s)")
    p.add_argument("--max-requests", type=int, default=1000, help="at most this many requests per point")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "reports")
    return p.parse_args(argv)


def verdict(row: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> str | None:
    """None when a measured load point held; otherwise what broke."""
    broken = []
    if row["num_failed"]:
        broken.append(f"{row['num_failed']} failures")
    if row["ttft_p99_ms"] is None or row["ttft_p99_ms"] > slo_ttft_ms:
        broken.append(f"TTFT p99 {fmt(row['ttft_p99_ms'], 'ms')} > {slo_ttft_ms:g} ms")
    if row["tpot_p99_ms"] is not None and row["tpot_p99_ms"] > slo_tpot_ms:
        broken.append(f"TPOT p99 {fmt(row['tpot_p99_ms'], 'ms')} > {slo_tpot_ms:g} ms")
    return "; ".join(broken) or None


def search(target, model: str, points: list[LoadPoint], plan: Plan, out_dir: Path, say=print) -> dict:
    """Step up through ``points`` until one breaks the SLO; return the best that held, the first that broke and
    those not measured."""
    best, broke, unmeasured, rows = None, None, [], []
    for point in points:
        run = run_load_point(target, model, point, plan, out_dir)
        row = summarize(run, plan.slo_ttft_ms, plan.slo_tpot_ms)
        rows.append(row)
        if row["not_measured"]:
            say(f"  {model} at {point.label}: not measured: {row['not_measured']}")
            unmeasured.append({"load": point.label, "why": row["not_measured"], "budget_spent": row["budget_spent"]})
            if row["budget_spent"]:
                break
            continue
        why = verdict(row, plan.slo_ttft_ms, plan.slo_tpot_ms)
        outcome = "ok" if why is None else f"BROKEN: {why}"
        say(
            f"  {model} at {point.label}: TTFT p99 {fmt(row['ttft_p99_ms'], 'ms')}, "
            f"TPOT p99 {fmt(row['tpot_p99_ms'], 'ms')}, {row['output_tok_per_s']:.0f} tok/s, "
            f"{row['num_failed']} failures -> {outcome}"
        )
        if why is not None:
            broke = {"load": point.label, "why": why}
            break
        best = row
    return {"model": model, "best": best, "first_violation": broke, "not_measured": unmeasured, "rows": rows}


def outcome_line(result: dict) -> str:
    """One model's answer: the highest load that held, where the ladder broke or stopped, and what went unmeasured."""
    best, broke, unmeasured = result["best"], result["first_violation"], result.get("not_measured", [])
    if best is not None:
        parts = [
            f"{best['load']} ({best['output_tok_per_s']:.0f} tok/s, {best['req_per_s']:.2f} req/s, "
            f"TTFT p99 {fmt(best['ttft_p99_ms'], 'ms')}, TPOT p99 {fmt(best['tpot_p99_ms'], 'ms')})"
        ]
    else:
        parts = ["none of the ladder" if broke else "no load point measured"]
    if broke:
        parts.append(f"broke at {broke['load']}: {broke['why']}")
    elif best is not None:
        parts.append("every measured point held" if unmeasured else "the whole ladder held")
    parts += [f"not measured at {point['load']}: {point['why']}" for point in unmeasured]
    if any(point["budget_spent"] for point in unmeasured):
        parts[-1] += " (raise --max-requests to measure higher loads)"
    return f"{result['model']:16s} " + "; ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = Plan(
        workload=args.workload,
        length_scale=args.length_scale,
        run_s=args.duration,
        ramp_s=min(5.0, args.duration / 4),
        max_requests=args.max_requests,
        protocol=args.protocol,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
    )
    if args.rates:
        points = [LoadPoint(args.max_users, float(r)) for r in args.rates.split(",")]
    else:
        points = [LoadPoint(int(u)) for u in args.users.split(",")]
    models = [m for m in args.models.split(",") if m]
    out_dir = args.out / ("slo-" + dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    say = lambda msg: print(f"[slo {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # noqa: E731
    say(
        f"SLO: TTFT p99 <= {args.slo_ttft_ms:g} ms, TPOT p99 <= {args.slo_tpot_ms:g} ms; {', '.join(models)}; "
        f"ladder {', '.join(p.label for p in points)}; {args.workload} workload; {args.duration:g} s per point"
    )
    try:
        with open_target(args, out_dir / "tritonserver.log", say=say) as target:
            check_models(target, models)
            for model in models:
                warm_up(target, model)
            results = [search(target, model, points, plan, out_dir, say) for model in models]
    except Exception as exc:
        print(f"slo: error: {exc}", file=sys.stderr)
        return 1
    (out_dir / "slo.json").write_text(json.dumps({"plan": dataclasses.asdict(plan), "results": results}, indent=1))
    print()
    print(f"Highest load within TTFT p99 <= {args.slo_ttft_ms:g} ms and TPOT p99 <= {args.slo_tpot_ms:g} ms:")
    for result in results:
        print(f"  {outcome_line(result)}")
    print(f"details: {out_dir / 'slo.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
