"""Find the highest load each model sustains within a TTFT p99 and a TPOT p99 limit.

    python -m loadtest.slo                                      # defaults: TTFT p99 <= 2000 ms, TPOT p99 <= 100 ms
    python -m loadtest.slo --slo-ttft-ms 1000 --slo-tpot-ms 80 --users 1,2,4,8,16,32
    python -m loadtest.slo --url http://127.0.0.1:8000 --rates 0.5,1,2,4 # open loop: highest request rate

The tuning procedure of the seed document (section 7), automated: for each model, step the load up (closed-loop
users, or Poisson arrival rates) and stop at the first load point whose p99 TTFT or p99 TPOT breaks its limit or
that has failures. The answer is the last load point that held. Every point is bounded like ``loadtest.compare``'s.
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
    """None when the load point held; otherwise what broke."""
    if row["num_requests"] == 0:
        return "no request completed"
    broken = []
    if row["num_failed"]:
        broken.append(f"{row['num_failed']} failures")
    if row["ttft_p99_ms"] is None or row["ttft_p99_ms"] > slo_ttft_ms:
        broken.append(f"TTFT p99 {fmt(row['ttft_p99_ms'], 'ms')} > {slo_ttft_ms:g} ms")
    if row["tpot_p99_ms"] is not None and row["tpot_p99_ms"] > slo_tpot_ms:
        broken.append(f"TPOT p99 {fmt(row['tpot_p99_ms'], 'ms')} > {slo_tpot_ms:g} ms")
    return "; ".join(broken) or None


def search(target, model: str, points: list[LoadPoint], plan: Plan, out_dir: Path, say=print) -> dict:
    """Step up through ``points`` until one breaks the SLO; return the best that held and the first that broke."""
    best, broke, rows = None, None, []
    for point in points:
        run = run_load_point(target, model, point, plan, out_dir)
        row = summarize(run, plan.slo_ttft_ms, plan.slo_tpot_ms)
        rows.append(row)
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
    return {"model": model, "best": best, "first_violation": broke, "rows": rows}


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
        best, broke = result["best"], result["first_violation"]
        held = (
            "none of the ladder"
            if best is None
            else (
                f"{best['load']} ({best['output_tok_per_s']:.0f} tok/s, {best['req_per_s']:.2f} req/s, "
                f"TTFT p99 {fmt(best['ttft_p99_ms'], 'ms')}, TPOT p99 {fmt(best['tpot_p99_ms'], 'ms')})"
            )
        )
        after = f"; broke at {broke['load']}: {broke['why']}" if broke else "; the whole ladder held"
        print(f"  {result['model']:16s} {held}{after}")
    print(f"details: {out_dir / 'slo.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
