"""``make slo --workload mixed`` without a server (loadtest/slo.py, loadtest/slo_mixed.py): each load point judged by
the interactive class alone, the ladder of batch users, the passes without and with priorities, and the report.

tests/server/test_loadtest.py runs a short one against a real server.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from loadtest import runner, slo, slo_mixed, stats
from loadtest.runner import LoadPoint, Plan, Target
from records.record import Record
from tests.unit.test_loadtest import record, steady_run

INTERACTIVE_TOKENS = [50.0, 150.0, 250.0, 350.0]  # TTFT 50 ms, TPOT 100 ms: within the targets (0.5 s, 100 ms)


def mixed_run(
    batch_users: int = 2,
    num_interactive: int = 40,
    late: int = 0,
    batch_ttft_ms: float = 5000.0,
    failed_batch: int = 0,
    priorities: bool = False,
    jobs_per_user: int = 2,
) -> dict:
    """A mixed load point over a 20 s window from 100 s: ``num_interactive`` interactive requests spread over it
    (the first ``late`` of them with a 900 ms TTFT), and ``jobs_per_user`` batch jobs per batch user a second apart,
    each of four tokens from ``batch_ttft_ms`` on (``failed_batch`` of them failed)."""
    run = steady_run(num_interactive, 20.0)
    for r in run["requests"]:
        r["class"] = "interactive"
    for r in run["requests"][:late]:
        r["ttft_ms"], r["token_ms"] = 900.0, [900.0, 1000.0, 1100.0, 1200.0]
    batch = [
        record(101.0 + i, [batch_ttft_ms + 100.0 * k for k in range(4)]) for i in range(jobs_per_user * batch_users)
    ]
    for r in batch[:failed_batch]:
        r.update(ok=False, error="error: boom")
    for r in batch:
        r["class"] = "batch"
    run["requests"] += batch
    run.update(users=batch_users, load=f"{batch_users} users", priorities=priorities, interactive_users=2)
    return run


def mixed_plan(**changes) -> Plan:
    return Plan(**{"workload": "mixed", "interactive_users": 2, "slo_ttft_ms": 500.0, "slo_tpot_ms": 100.0, **changes})


@pytest.mark.timeout(10)
def test_a_mixed_point_is_judged_by_the_interactive_class_alone():
    plan = mixed_plan()
    judge = slo_mixed.InteractiveClass(plan)
    run = mixed_run(batch_users=2)
    # The batch jobs' 5 s TTFTs would break the load point as one class; the interactive class holds.
    assert slo.verdict(slo.WholeLoad(plan).row(run), plan.slo_ttft_ms, plan.slo_tpot_ms) is not None
    row = judge.row(run)
    assert slo.verdict(row, plan.slo_ttft_ms, plan.slo_tpot_ms) is None
    assert (row["num_requests"], row["ttft_p99_ms"], row["tpot_p99_ms"], row["within_targets"]) == (
        40,
        50.0,
        100.0,
        1.0,
    )
    # Four batch jobs are too few for their latencies, not for their tokens/s: the 16 tokens that arrived in 20 s.
    assert row["batch_requests"] == 4 and row["batch_tok_per_s"] == pytest.approx(16 / 20.0)
    assert row["not_measured"] is None and row["priorities"] is False

    late = judge.row(mixed_run(late=2))  # two of forty over the TTFT target: the p99 is
    assert slo.verdict(late, 500.0, 100.0) == "TTFT p99 900 ms > 500 ms" and late["within_targets"] == 0.95
    failed = judge.row(mixed_run(failed_batch=1))  # a failed batch job breaks the point too
    assert slo.verdict(failed, 500.0, 100.0) == "1 failures"
    # Too few interactive requests for a p99 (among enough requests in all): not measured.
    sparse = judge.row(mixed_run(num_interactive=10, jobs_per_user=6))
    assert sparse["not_measured"] == "interactive class: 10 requests in 20 s: too few to measure"
    assert sparse["ttft_p99_ms"] is None and sparse["batch_tok_per_s"] is None
    # ... unless those few missed a target more often than a p99 on target allows: then the point breaks.
    one_late = judge.row(mixed_run(num_interactive=10, late=1, jobs_per_user=6))
    assert one_late["not_measured"] == sparse["not_measured"]  # one miss in ten could be the one in a hundred
    two_late = judge.row(mixed_run(num_interactive=10, late=2, jobs_per_user=6))
    assert two_late["not_measured"] is None and two_late["ttft_p99_ms"] is None
    assert slo.verdict(two_late, 500.0, 100.0) == (
        "2 of 10 interactive requests missed a target (too few for a p99, too many misses for one on target)"
    )
    assert slo_mixed.misses([record(0.0, [100.0, 900.0]), record(0.0, [600.0], cut=True)], 500.0, 100.0) == 2
    # Too few requests in all (a batcher that makes every request slow) is judged the same way.
    few = judge.row(mixed_run(num_interactive=10, late=2))
    assert stats.summarize(mixed_run(num_interactive=10), 500.0, 100.0)["not_measured"] is not None
    assert few["missed"] == two_late["missed"] and slo.verdict(few, 500.0, 100.0) == slo.verdict(two_late, 500, 100)
    assert judge.row(mixed_run(num_interactive=10))["not_measured"].startswith("interactive class: 10 requests")
    # A window too short to judge, or one the request budget ended, stays unmeasured whatever its requests say.
    short = mixed_run(num_interactive=10, late=5)
    short["window"] = (100.0, 104.0)
    assert judge.row(short)["not_measured"] == "5 requests in 4 s: too few to measure"  # the point's, not the class's
    idle = judge.row(mixed_run(batch_users=0))  # the interactive class alone
    assert idle["batch_tok_per_s"] == 0.0 and slo.verdict(idle, 500.0, 100.0) is None

    # Tighter targets from the command line hold the interactive class to them.
    strict = slo_mixed.InteractiveClass(mixed_plan(slo_ttft_ms=40.0, slo_tpot_ms=100.0))
    assert strict.classes[0]["ttft_ms"] == 40.0 and strict.row(run)["within_targets"] == 0.0
    assert slo.verdict(strict.row(run), 40.0, 100.0) == "TTFT p99 50 ms > 40 ms"


@pytest.mark.timeout(10)
def test_the_mixed_ladder_steps_the_batch_users_up_until_the_interactive_class_breaks(monkeypatch):
    runs = {0: mixed_run(0), 1: mixed_run(1), 2: mixed_run(2, num_interactive=10, jobs_per_user=6), 4: mixed_run(4),
            8: mixed_run(8, late=4), 16: mixed_run(16)}  # fmt: skip
    ran = []
    monkeypatch.setattr(
        runner,
        "run_load_point",
        lambda target, model, point, plan, out_dir: ran.append(point.users) or runs[point.users],
    )
    said = []
    points = [LoadPoint(u) for u in (0, 1, 2, 4, 8, 16)]
    plan = mixed_plan()
    result = slo.search(None, "m", points, plan, Path("unused"), said.append, slo_mixed.InteractiveClass(plan))
    assert ran == [0, 1, 2, 4, 8]  # stopped at the first break
    assert result["best"]["load"] == "4 users" and result["best"]["batch_tok_per_s"] == pytest.approx(32 / 20.0)
    assert result["first_violation"] == {"load": "8 users", "why": "TTFT p99 900 ms > 500 ms"}
    assert [p["load"] for p in result["not_measured"]] == ["2 users"]
    assert said[3] == (
        "  m at 4 users: interactive TTFT p99 50 ms, TPOT p99 100 ms, 100% within targets; batch 2 "
        "tok/s; 0 failures -> ok"
    )
    line = slo.outcome_line({**result, "priorities": True}, slo_mixed.InteractiveClass.best_figures)
    assert line.startswith("m, priorities on 4 users (interactive TTFT p99 50 ms")
    assert "broke at 8 users: TTFT p99 900 ms > 500 ms; not measured at 2 users: interactive class: 10" in line


@pytest.mark.timeout(10)
def test_make_slo_takes_the_mixed_workload_with_the_interactive_targets_and_a_ladder_of_batch_users():
    args = slo.parse_args(["--workload", "mixed", "--priorities", "both"])
    assert (args.slo_ttft_ms, args.slo_tpot_ms) == (500.0, 100.0)  # the interactive class's, not make slo's 2 s
    assert (args.users, args.duration, args.interactive_users) == ("0,1,2,4,8", 60.0, 2)
    assert args.models == "llm_static,llm_dynamic,llm_iterative,llm_continuous"
    assert runner.engine_parameters(args) == {"scheduling_policy": "priority"}
    strict = slo.parse_args(
        ["--workload", "mixed", "--slo-ttft-ms", "300", "--users", "1,3", "--models", "llm_dynamic"]
    )
    assert (strict.slo_ttft_ms, strict.users, strict.models) == (300.0, "1,3", "llm_dynamic")
    plain = slo.parse_args([])
    assert (plain.slo_ttft_ms, plain.users, plain.duration) == (2000.0, slo.LADDER_USERS, 30.0)
    for bad in (["--workload", "mixed", "--capacity"], ["--workload", "mixed", "--rates", "1"],
                ["--priorities", "on"], ["--workload", "mixed", "--interactive-users", "-1"]):  # fmt: skip
        with pytest.raises(SystemExit):
            slo.parse_args(bad)


@pytest.mark.timeout(60)
def test_make_slo_mixed_runs_each_pass_for_every_model_and_reports_the_highest_batch_load(
    tmp_path, monkeypatch, capsys
):
    """The whole command with the server and Locust replaced: without priorities the interactive class of
    llm_dynamic breaks at 2 batch users, with them at 4; llm_continuous holds the whole ladder either way."""
    breaks_at = {("llm_dynamic", False): 2, ("llm_dynamic", True): 4, ("llm_continuous", False): 99,
                 ("llm_continuous", True): 99}  # fmt: skip
    ran = []

    def run_load_point(target, model, point, plan, out_dir):
        ran.append((model, point.users, plan.priorities, plan.interactive_users))
        return {**mixed_run(point.users, late=4 if point.users >= breaks_at[model, plan.priorities] else 0,
                            priorities=plan.priorities), "model": model}  # fmt: skip

    @contextlib.contextmanager
    def open_target(args, log_path, say=print):
        yield Target("http://127.0.0.1:1", "127.0.0.1:2", "http://127.0.0.1:3/metrics")

    monkeypatch.setattr(runner, "run_load_point", run_load_point)
    monkeypatch.setattr(runner, "open_target", open_target)
    monkeypatch.setattr(runner, "check_models", lambda target, models: {m: {"dynamic_batching": {}} for m in models})
    monkeypatch.setattr(runner, "warm_up", lambda target, model: 0.0)
    monkeypatch.setattr("records.record.provenance", lambda measure_bandwidth=True: {"commit": "c" * 40})
    argv = ["--workload", "mixed", "--priorities", "both", "--models", "llm_dynamic,llm_continuous", "--users",
            "0,2,4", "--interactive-users", "3", "--out", str(tmp_path)]  # fmt: skip
    assert slo.main(argv) == 0

    # One pass after the other, each model's ladder in turn, every point with the 3 interactive users.
    assert ran == [("llm_dynamic", 0, False, 3), ("llm_dynamic", 2, False, 3), ("llm_continuous", 0, False, 3),
                   ("llm_continuous", 2, False, 3), ("llm_continuous", 4, False, 3), ("llm_dynamic", 0, True, 3),
                   ("llm_dynamic", 2, True, 3), ("llm_dynamic", 4, True, 3), ("llm_continuous", 0, True, 3),
                   ("llm_continuous", 2, True, 3), ("llm_continuous", 4, True, 3)]  # fmt: skip
    (out_dir,) = tmp_path.iterdir()
    summary = json.loads((out_dir / "slo.json").read_text())
    assert [(r["model"], r["priorities"], r["best"] and r["best"]["load"]) for r in summary["results"]] == [
        ("llm_dynamic", False, "0 users"), ("llm_continuous", False, "4 users"), ("llm_dynamic", True, "2 users"),
        ("llm_continuous", True, "4 users")]  # fmt: skip
    assert summary["plan"]["interactive_users"] == 3 and summary["classes"][0]["ttft_ms"] == 500.0
    # The served copies order the engine's queue by priority (both passes: the levels decide).
    assert "scheduling_policy" in (out_dir / "model_repository" / "llm_dynamic" / "config.pbtxt").read_text()

    kept = Record.read(out_dir / "record.json")
    assert kept.command == "make slo --workload mixed" and list(kept.tables) == ["mixed"]
    table = kept.tables["mixed"]
    none = {"model": "m", "best": None, "first_violation": None, "not_measured": [{"load": "0 users"}], "rows": []}
    assert slo_mixed.mixed_rows([none])[0]["batch_load"] == "no load point measured"
    assert [(r["model"], r["priorities"], r["batch_load"]) for r in table.rows] == [
        ("llm_dynamic", "off", "0 users"), ("llm_continuous", "off", "4 users"), ("llm_dynamic", "on", "2 users"),
        ("llm_continuous", "on", "4 users")]  # fmt: skip
    printed = capsys.readouterr().out
    assert "Highest batch load with 3 interactive users within TTFT p99 <= 500 ms and TPOT p99 <= 100 ms" in printed
    assert "| llm_dynamic | off | 0 users | 50 ms | 100 ms | 100% | 0 | 2 users: TTFT p99 900 ms > 500 ms |" in printed
    assert "| llm_continuous | on | 4 users | 50 ms | 100 ms | 100% | 2 | – |" in printed
    assert table.markdown() in printed


@pytest.mark.timeout(10)
def test_a_class_of_a_few_long_requests_still_has_a_token_rate():
    run = mixed_run(batch_users=1)  # two batch jobs: no latency percentiles, but 8 tokens in the window
    _, batch = stats.summarize_classes(run, slo_mixed.classes(500.0, 100.0))
    assert batch["not_measured"] and batch["output_tok_per_s"] is None
    assert stats.class_tok_per_s(run, "batch") == pytest.approx(8 / 20.0)
    assert stats.class_tok_per_s(run, "interactive") == pytest.approx(
        stats.summarize_classes(run, slo_mixed.classes(500.0, 100.0))[0]["output_tok_per_s"]
    )
