"""``make slo --workload mixed``: the highest batch load at which the interactive class still meets its targets.

Each load point is ``--interactive-users`` interactive users beside the point's batch users (``loadtest.workloads``'
:data:`~loadtest.workloads.MIXED`), and ``loadtest.slo``'s ladder steps the batch users up as it steps any load up.
What judges a point is the interactive class alone (:class:`InteractiveClass`): its TTFT p99 and TPOT p99 against
its targets (the class's own, 0.5 s and 100 ms, unless ``--slo-ttft-ms``/``--slo-tpot-ms`` say otherwise), and no
failure of either class. A point whose interactive class finished too few requests in the window to give a p99 is
"not measured", as a sparse load point is, unless those few already missed a target too often for any p99 within it
(:data:`MISSES_THAT_BREAK`): a batcher that keeps interactive requests waiting for whole batch jobs finishes few of
them, and that is the answer, not a gap. The batch class has no target: its output tokens/s is what the batch load
bought at the highest point that held.
"""

from __future__ import annotations

import dataclasses

from loadtest import runner
from loadtest.report import fmt
from loadtest.stats import MIN_WINDOW_S, LoadPointRow, class_tok_per_s, started_in_window, summarize_classes
from loadtest.workloads import MIXED
from records.record import Column

INTERACTIVE, BATCH = MIXED.classes
# The batch users a mixed ladder tries by default: none first (the interactive class alone: can it meet its targets
# at all?), then doubling.
MIXED_USERS = "0,1,2,4,8"
MIXED_DURATION_S = 60.0  # two interactive users finish well over stats.MIN_REQUESTS requests when on target
# A p99 within its target lets one request in a hundred miss it: two misses among the fewer than stats.MIN_REQUESTS
# requests of a sparse window would happen less than 2% of the time if it held (binomial), so such a point breaks.
MISSES_THAT_BREAK = 2


def misses(requests: list[dict], ttft_ms: float, tpot_ms: float) -> int:
    """How many of ``requests`` are known to have missed a target: a first token later than ``ttft_ms`` (a request
    cut off by the end of the run too), or a finished request's TPOT over ``tpot_ms``."""
    return sum(
        1 for r in requests
        if (r["ttft_ms"] is not None and r["ttft_ms"] > ttft_ms) or (r["ok"] and (r["tpot_ms"] or 0.0) > tpot_ms)
    )  # fmt: skip


def classes(slo_ttft_ms: float, slo_tpot_ms: float) -> list[dict]:
    """The mixed workload's classes as ``stats.summarize_classes`` reads them, the interactive class held to these
    targets."""
    interactive = dataclasses.replace(INTERACTIVE, ttft_ms=slo_ttft_ms, tpot_ms=slo_tpot_ms)
    return [interactive.describe(), BATCH.describe()]


class InteractiveClass:
    """How ``loadtest.slo.search`` judges a mixed load point: a row of the interactive class's figures (what
    ``slo.verdict`` reads: its p99s, and the failures of both classes), with the batch class's tokens/s beside them.
    """

    def __init__(self, plan: runner.Plan) -> None:
        self.plan = plan
        self.classes = classes(plan.slo_ttft_ms, plan.slo_tpot_ms)

    def row(self, run: dict) -> dict:
        whole = LoadPointRow.summarize(run, self.plan.slo_ttft_ms, self.plan.slo_tpot_ms)
        interactive, batch = summarize_classes(run, self.classes)
        sparse = interactive["not_measured"] and f"{INTERACTIVE.name} class: {interactive['not_measured']}"
        # NOTE: a window too short, or one ended by the request budget, gives nothing to judge; a point of too few
        # requests in all is judged by its interactive class (a subset: too few there too).
        unjudged = whole.not_measured and (whole.budget_spent or whole.window_s < MIN_WINDOW_S)
        row = {
            "model": run["model"],
            "load": run["load"],
            "users": run["users"],
            "priorities": bool(run.get("priorities")),
            "num_requests": interactive["num_requests"],
            "num_failed": whole.num_failed,  # NOTE: either class's: a server failing batch jobs holds nothing
            "ttft_p50_ms": interactive["ttft_p50_ms"],
            "ttft_p99_ms": interactive["ttft_p99_ms"],
            "tpot_p50_ms": interactive["tpot_p50_ms"],
            "tpot_p99_ms": interactive["tpot_p99_ms"],
            "within_targets": interactive["within_targets"],
            "interactive_tok_per_s": interactive["output_tok_per_s"],
            "batch_tok_per_s": class_tok_per_s(run, BATCH.name),
            "batch_requests": batch["num_requests"],
            "budget_spent": whole.budget_spent,
            "not_measured": (whole.not_measured if unjudged else sparse) or None,
            "missed": None,
        }
        if sparse and not unjudged:
            interactive_requests = [r for r in started_in_window(run) if r.get("class") == INTERACTIVE.name]
            missed = misses(interactive_requests, self.plan.slo_ttft_ms, self.plan.slo_tpot_ms)
            if missed >= MISSES_THAT_BREAK:
                row["not_measured"] = None
                row["missed"] = (f"{missed} of {len(interactive_requests)} {INTERACTIVE.name} requests missed a target "
                                 "(too few for a p99, too many misses for one on target)")  # fmt: skip
        if row["not_measured"]:
            row["batch_tok_per_s"] = None
        return row

    @staticmethod
    def figures(row: dict) -> str:
        """A measured point as the ladder's progress line and the outcome line say it."""
        return (
            f"{INTERACTIVE.name} TTFT p99 {fmt(row['ttft_p99_ms'], 'ms')}, TPOT p99 {fmt(row['tpot_p99_ms'], 'ms')}, "
            f"{fmt(row['within_targets'], '{:.0%}')} within targets; {BATCH.name} "
            f"{fmt(row['batch_tok_per_s'], '{:.0f}')} tok/s; {row['num_failed']} failures"
        )

    best_figures = figures


MIXED_COLUMNS = [
    Column("model"), Column("priorities"),
    Column("batch_load", "highest batch load within targets"),
    Column("ttft_p99_ms", f"{INTERACTIVE.name} TTFT p99", "ms"),
    Column("tpot_p99_ms", f"{INTERACTIVE.name} TPOT p99", "ms"),
    Column("within_targets", f"{INTERACTIVE.name} within targets", "{:.0%}"),
    Column("batch_tok_per_s", f"{BATCH.name} tok/s", "{:.0f}"),
    Column("broke", "first batch load that broke"),
]  # fmt: skip


def mixed_rows(results: list[dict]) -> list[dict]:
    """Per model and pass: the highest batch load that held, the figures there, and the first that broke; the rows
    of the printed table and of the run's record."""
    rows = []
    for result in results:
        best, broke = result["best"] or {}, result["first_violation"]
        rows.append({
            "model": result["model"], "priorities": "on" if result.get("priorities") else "off",
            "batch_load": best.get("load", "none of the ladder" if broke else "no load point measured"),
            "ttft_p99_ms": best.get("ttft_p99_ms"),
            "tpot_p99_ms": best.get("tpot_p99_ms"), "within_targets": best.get("within_targets"),
            "batch_tok_per_s": best.get("batch_tok_per_s"),
            "broke": f"{broke['load']}: {broke['why']}" if broke else None,
        })  # fmt: skip
    return rows


def mixed_title(plan: runner.Plan) -> str:
    return (
        f"{plan.interactive_users} {INTERACTIVE.name} users within TTFT p99 <= {plan.slo_ttft_ms:g} ms and TPOT p99 "
        f"<= {plan.slo_tpot_ms:g} ms, beside a rising number of {BATCH.name} users"
    )
