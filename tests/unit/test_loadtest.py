"""The load tests' parts without a server: workloads, metrics parsing, the measurement window, the report and its plots,
the SLO ladder, the capacity plan, the soak's accounting, verdict and crash report.

tests/server/test_loadtest.py runs headless Locust and `make compare --smoke` against real servers.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import random
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from backend.contract import errors
from backend.contract.errors import ErrorKind
from backend.contract.priority import BATCH, INTERACTIVE
from backend.triton.launcher import config_text
from client.schema import Chunk
from loadtest import compare, metrics, report, runner, slo, soak, soak_patterns, soak_plan, stats
from loadtest.measure import Measurement, StreamError
from loadtest.runner import REPO_ROOT, LoadPoint, Plan, Target, batcher_settings, measurement_window
from loadtest.served import Served, forced_models
from loadtest.slo import verdict
from loadtest.workloads import WORKLOAD_NAMES, WORKLOADS, deal_user, get_workload, make_request
from records.record import Record

FIXTURE = Path(__file__).parents[1] / "data" / "loadtest_results.json"


@pytest.mark.timeout(10)
def test_shared_prefix_prompts_start_with_one_of_the_workloads_prefixes():
    workload = get_workload("shared_prefix")
    specs = [make_request(workload, i) for i in range(400)]
    heads = {" ".join(s.prompt.split()[: workload.prefix_words]) for s in specs}
    assert len(heads) == workload.prefixes  # every prefix used, none made up
    assert all(s.num_prompt_words == len(s.prompt.split()) > workload.prefix_words for s in specs)
    assert make_request(workload, 7) == specs[7] and make_request(workload, 7, seed=1).prompt != specs[7].prompt
    quarter = get_workload("shared_prefix", 0.25)
    assert quarter.prefix_words == workload.prefix_words // 4 and quarter.prefixes == workload.prefixes


def test_request_i_is_the_same_everywhere_and_long_tailed_is_long_tailed():
    workload = get_workload("long_tailed")
    assert make_request(workload, 7, seed=3) == make_request(workload, 7, seed=3)
    assert make_request(workload, 7, seed=3) != make_request(workload, 7, seed=4)
    specs = [make_request(workload, i) for i in range(2000)]
    long = [s for s in specs if s.max_tokens >= 256]
    assert 0.07 < len(long) / len(specs) < 0.13  # about one in ten
    assert all(16 <= s.max_tokens <= 64 or 256 <= s.max_tokens <= 512 for s in specs)
    assert all(len(s.prompt.split()) == s.num_prompt_words for s in specs[:50])


@pytest.mark.timeout(10)
def test_scaled_workloads_keep_their_shape():
    quick = [make_request(get_workload("long_tailed", 0.5), i).max_tokens for i in range(500)]
    assert max(quick) <= 256 and min(quick) >= 8
    small = [make_request(get_workload("constant", 0.1), i) for i in range(20)]
    assert {(s.num_prompt_words, s.max_tokens) for s in small} == {(6, 13)}  # prompts scale with outputs
    with pytest.raises(ValueError, match="unknown workload"):
        get_workload("nope")
    assert set(WORKLOADS) == {"constant", "uniform", "long_tailed", "bimodal", "shared_prefix"}


def chunk(t: float, n: int = 1, reason: str | None = None) -> Chunk:
    return Chunk(
        text="x" * n,
        output_ids=tuple(range(n)),
        finish_reason=reason,
        num_input_tokens=12,
        num_output_tokens=None,
        time_s=t,
    )


@pytest.mark.timeout(10)
def test_measurement_times_tokens_and_flags_truncated_streams():
    m = Measurement(index=0, max_tokens=4, t_start_unix=100.0)
    for t, reason in ((0.5, None), (0.6, None), (0.9, None), (1.0, "length")):
        m.add(chunk(t, reason=reason))
    m.e2e_s = 1.01
    m.check_complete()
    assert (m.ttft_s, round(m.tpot_s, 6), round(m.itl_max_s, 6)) == (0.5, round(0.5 / 3, 6), 0.3)
    record = m.record()
    assert record["token_ms"] == [500.0, 600.0, 900.0, 1000.0] and record["ok"] and record["num_input_tokens"] == 12

    short = Measurement(index=1, max_tokens=4, t_start_unix=100.0)
    short.add(chunk(0.5, n=2, reason="length"))
    with pytest.raises(StreamError, match="2 of 4 tokens"):
        short.check_complete()
    unfinished = Measurement(index=2, max_tokens=1, t_start_unix=100.0)
    unfinished.add(chunk(0.5))
    with pytest.raises(StreamError, match="without finish_reason"):
        unfinished.check_complete()


PROMETHEUS_TEXT = """
# HELP llm_batch_size Sequences in each forward step
# TYPE llm_batch_size histogram
llm_batch_size_bucket{model="llm_dynamic",le="1"} 3
llm_batch_size_bucket{model="llm_dynamic",le="2"} 5
llm_batch_size_bucket{model="llm_dynamic",le="+Inf"} 10
llm_batch_size_sum{model="llm_dynamic"} 25
llm_batch_size_count{model="llm_dynamic"} 10
llm_num_requests_running{model="llm_continuous"} 4
nv_inference_pending_request_count{model="llm_dynamic",version="1"} 6
llm_request_success_total{finish_reason="length",model="llm_dynamic"} 9
nv_gpu_utilization{gpu_uuid="x"} 0.5
garbage line
"""


@pytest.mark.timeout(10)
def test_prometheus_text_is_selected_by_model_and_prefix():
    values = metrics.select(metrics.parse_prometheus(PROMETHEUS_TEXT), "llm_dynamic")
    assert values['llm_batch_size_bucket{le="2"}'] == 5
    assert values["llm_batch_size_count"] == 10
    assert values["nv_inference_pending_request_count"] == 6
    assert values['llm_request_success_total{finish_reason="length"}'] == 9
    assert "llm_num_requests_running" not in values and not any(k.startswith("nv_gpu") for k in values)
    assert "llm_batch_size_bucket" not in "".join(
        metrics.select(metrics.parse_prometheus(PROMETHEUS_TEXT), "llm_dynamic", buckets=False)
    )


@pytest.mark.timeout(10)
def test_a_model_with_several_instances_is_read_as_the_sum_of_its_instances():
    from backend.triton.stub.metrics import instance_label

    text = """
llm_kv_blocks_used{instance="llm_dynamic_0_0",model="llm_dynamic"} 30
llm_kv_blocks_used{instance="llm_dynamic_0_1",model="llm_dynamic"} 12
llm_kv_blocks_total{instance="llm_dynamic_0_0",model="llm_dynamic"} 1024
llm_kv_blocks_total{instance="llm_dynamic_0_1",model="llm_dynamic"} 1024
llm_batch_size_count{instance="llm_dynamic_0_0",model="llm_dynamic"} 7
llm_batch_size_count{instance="llm_dynamic_0_1",model="llm_dynamic"} 5
"""
    values = metrics.select(metrics.parse_prometheus(text), "llm_dynamic")
    assert values == {"llm_kv_blocks_used": 42, "llm_kv_blocks_total": 2048, "llm_batch_size_count": 12}
    # Only a model served by several instances labels its series by instance (one instance keeps the plain labels).
    args = {"model_instance_name": "llm_dynamic_0_1"}
    assert instance_label(args, {"instance_group": [{"count": 2, "kind": "KIND_CPU"}]}) == "llm_dynamic_0_1"
    assert instance_label(args, {"instance_group": [{"count": 1, "kind": "KIND_CPU"}]}) is None
    assert instance_label(args, {}) is None


@pytest.mark.timeout(10)
def test_histogram_deltas_give_steps_per_second_and_batch_size():
    samples = [
        {
            "t": 10.0,
            "values": {
                "llm_batch_size_count": 100,
                "llm_batch_size_sum": 400,
                'llm_batch_size_bucket{le="1"}': 10,
                'llm_batch_size_bucket{le="+Inf"}': 100,
            },
        },
        {"t": 10.5, "values": {"llm_batch_size_count": 110, "llm_batch_size_sum": 480}},
        {"t": 11.0, "values": {"llm_batch_size_count": 110, "llm_batch_size_sum": 480}},  # idle: left out
        {
            "t": 11.5,
            "values": {
                "llm_batch_size_count": 130,
                "llm_batch_size_sum": 500,
                'llm_batch_size_bucket{le="1"}': 30,
                'llm_batch_size_bucket{le="+Inf"}': 130,
            },
        },
    ]
    assert metrics.histogram_rate(samples, "llm_batch_size") == [(10.25, 20.0, 8.0), (11.25, 40.0, 1.0)]
    assert metrics.histogram_delta(samples[0]["values"], samples[-1]["values"], "llm_batch_size") == {
        "1": 20,
        "+Inf": 10,
    }


def record(t_start: float, token_ms: list[float], error: str | None = None, cut: bool = False) -> dict:
    """A records-file line as the Locust users write it (times in ms since the request was sent)."""
    done = error is None and not cut
    n = len(token_ms)
    return {
        "t_start": t_start,
        "ok": done,
        "error": error,
        "cut": cut,
        "ttft_ms": token_ms[0] if token_ms else None,
        "tpot_ms": (token_ms[-1] - token_ms[0]) / (n - 1) if done and n > 1 else None,
        "e2e_ms": token_ms[-1] + 1.0 if token_ms else 10.0,
        "num_output_tokens": n,
        "token_ms": token_ms,
    }


@pytest.mark.timeout(10)
def test_window_counts_tokens_that_arrived_in_it_and_latency_of_requests_started_in_it(monkeypatch):
    monkeypatch.setattr(stats, "MIN_REQUESTS", 1)  # four requests in 4 s: the arithmetic, not the rule below
    monkeypatch.setattr(stats, "MIN_WINDOW_S", 1.0)
    early = record(99.0, [500.0, 1000.0, 1500.0])  # tokens at 99.5, 100.0, 100.5; done at 100.501
    inside = record(101.0, [100.0, 4900.0])  # its second token comes after the window
    failed = record(102.0, [], error="error: boom")
    cut = record(103.0, [300.0, 5000.0], cut=True)  # still streaming when the drain limit ended the run
    run = {
        "model": "m",
        "users": 2,
        "arrival_rate": 0.0,
        "load": "2 users",
        "requests": [early, inside, failed, cut],
        "metrics": [],
        "window": (100.0, 104.0),
    }
    row = stats.summarize(run, slo_ttft_ms=200, slo_tpot_ms=200)
    assert row["num_requests"] == 3  # the early request is not in the latencies
    assert (row["num_failed"], row["num_unfinished"], row["errors"]) == (1, 1, ["error: boom"])
    assert row["output_tok_per_s"] == 4 / 4  # 100.0, 100.5 (early), 101.1 (inside), 103.3 (cut)
    assert row["req_per_s"] == 1 / 4  # only the early one completed inside the window
    assert row["ttft_p50_ms"] == 200.0  # inside (100 ms) and cut (300 ms): a cut request's first token counts
    assert row["e2e_p99_ms"] == 4901.0 and row["goodput_req_per_s"] == 0.0  # inside's TPOT is 4.8 s
    assert measurement_window(
        [{"event": "test_start", "t": 5.0}, {"event": "stop_issuing", "t": 20.0}, {"event": "test_stop", "t": 30.0}],
        ramp_s=3,
    ) == (8.0, 20.0)


def steady_run(num_requests: int, window_s: float, stop_reason: str = "stopping", model: str = "m") -> dict:
    """A closed-loop run whose ``num_requests`` requests start evenly in a window of ``window_s`` seconds from 100 s,
    each with four tokens 100 ms apart."""
    step = window_s / num_requests if num_requests else window_s
    return {
        "model": model,
        "users": 8,
        "arrival_rate": 0.0,
        "load": "8 users",
        "requests": [record(100.0 + i * step, [50.0, 150.0, 250.0, 350.0]) for i in range(num_requests)],
        "events": [
            {"event": "test_start", "t": 95.0},
            {"event": "stop_issuing", "t": 100.0 + window_s, "reason": stop_reason},
            {"event": "test_stop", "t": 101.0 + window_s},
        ],
        "metrics": [],
        "window": (100.0, 100.0 + window_s),
    }


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "num_requests,window_s,stop_reason,reason",
    [
        (3, 30.0, "stopping", "3 requests in 30 s: too few to measure"),
        (3, 0.48, "stopping", "3 requests in 0.48 s: too few to measure"),
        (40, 2.5, "stopping", "40 requests in 2.5 s: window too short to measure"),
        (3, 0.48, "max_requests", "request budget spent (3 requests in 0.48 s)"),
        (0, 0.0, "max_requests", "request budget spent (0 requests in 0 s)"),
    ],
)
def test_a_window_too_short_or_too_sparse_gives_no_figures(num_requests, window_s, stop_reason, reason):
    row = stats.summarize(steady_run(num_requests, window_s, stop_reason), slo_ttft_ms=2000, slo_tpot_ms=100)
    assert row["not_measured"] == reason
    assert (row["num_requests"], row["window_s"]) == (num_requests, pytest.approx(window_s))  # the counts stay
    figures = ("req_per_s", "output_tok_per_s", "goodput_req_per_s", "ttft_p99_ms", "tpot_p50_ms", "e2e_p99_ms")
    assert all(row[key] is None for key in figures)
    cells = report.table_rows([stats.LoadPointRow(**row)])[0]
    assert cells[2] == f"not measured: {reason}" and set(cells[3:11]) == {"–"}


@pytest.mark.timeout(10)
def test_a_normal_window_is_measured_even_when_its_budget_ran_out():
    for stop_reason in ("stopping", "max_requests"):
        row = stats.summarize(steady_run(40, 20.0, stop_reason), slo_ttft_ms=2000, slo_tpot_ms=100)
        assert row["not_measured"] is None and row["budget_spent"] == (stop_reason == "max_requests")
        assert (row["req_per_s"], row["output_tok_per_s"], row["ttft_p99_ms"]) == (2.0, 8.0, 50.0)
        assert verdict(row, 2000, 100) is None
        typed = stats.LoadPointRow.summarize(steady_run(40, 20.0, stop_reason), slo_ttft_ms=2000, slo_tpot_ms=100)
        assert typed == stats.LoadPointRow(**row) and typed.measured
        assert list(typed.to_json().items()) == list(row.items())  # summary.json and the record keep the same JSON
        assert report.table_rows([typed])[0][2] == "2.00"


@pytest.mark.timeout(10)
def test_slo_ladder_skips_a_sparse_point_and_stops_where_the_budget_ran_out(monkeypatch):
    runs = iter([steady_run(5, 30.0), steady_run(40, 20.0), steady_run(3, 0.48, "max_requests"), steady_run(40, 20.0)])
    monkeypatch.setattr(runner, "run_load_point", lambda *args: next(runs))
    said = []
    points = [LoadPoint(u) for u in (1, 4, 8, 12)]
    result = slo.search(None, "m", points, Plan(), Path("unused"), say=said.append)
    assert result["best"]["load"] == "8 users" and result["first_violation"] is None  # the fixture calls all "8 users"
    assert [p["load"] for p in result["not_measured"]] == ["1 users", "8 users"] and len(result["rows"]) == 3
    assert said[0] == "  m at 1 users: not measured: 5 requests in 30 s: too few to measure"
    assert said[2] == "  m at 8 users: not measured: request budget spent (3 requests in 0.48 s)"
    assert not any("BROKEN" in line for line in said)
    line = slo.outcome_line(result)
    assert "every measured point held; not measured at 1 users: 5 requests in 30 s: too few to measure" in line
    assert line.endswith("not measured at 8 users: request budget spent (3 requests in 0.48 s) (raise --max-requests "
                         "to measure higher loads)")


@pytest.mark.timeout(60)
def test_report_marks_points_not_measured_and_leaves_them_out_of_the_plots(tmp_path):
    results = json.loads(FIXTURE.read_text())
    sparse = next(run for run in results["runs"] if run["model"] == "llm_dynamic" and run["users"] == 4)
    start = sparse["window"][0]
    sparse["window"] = [start, start + 0.48]  # a handful of requests in half a second
    built = report.build(results, tmp_path)

    assert built["headline"].startswith("continuous vs dynamic at 2 users:")  # the highest load with both measured
    row = next(r for r in built["rows"] if r.model == "llm_dynamic" and r.users == 4)
    reason = row.not_measured
    assert reason.endswith("in 0.48 s: too few to measure")
    md = (tmp_path / "report.md").read_text()
    assert f"| llm_dynamic | 4 users | not measured: {reason} | – |" in md
    assert f"| 4 users | not measured (llm_dynamic: {reason}) |" in md
    assert f"llm_dynamic at 4 users ({reason})" in md.split("**Not measured:**")[1]
    assert "## Why: batch size over time at 2 users" in md
    assert (tmp_path / "throughput_vs_load.png").stat().st_size > 15_000


# As /v2/models/<model>/config answers (Triton fills in preferred_batch_size when config.pbtxt has none).
SERVED_CONFIGS = {
    "llm_dynamic": {
        "name": "llm_dynamic",
        "max_batch_size": 8,
        "dynamic_batching": {"preferred_batch_size": [8], "max_queue_delay_microseconds": 2000},
        "instance_group": [{"name": "llm_dynamic_0", "kind": "KIND_CPU", "count": 2}],
        "parameters": {
            "max_num_seqs": {"string_value": "8"},
            "max_num_batched_tokens": {"string_value": "2048"},
            "kv_cache_memory_bytes": {"string_value": "536870912"},
        },
    },
    "llm_continuous": {
        "name": "llm_continuous",
        "max_batch_size": 0,
        "instance_group": [{"name": "llm_continuous_0", "kind": "KIND_CPU", "count": 1}],
        "parameters": {"max_num_seqs": {"string_value": "8"}, "num_kv_blocks": {"string_value": "300"}},
    },
}


@pytest.mark.timeout(60)
def test_report_states_every_batcher_setting_as_served(tmp_path):
    settings = batcher_settings(SERVED_CONFIGS["llm_dynamic"])
    assert settings == {
        "batcher": "dynamic",
        "max_batch_size": 8,
        "preferred_batch_size": [8],
        "max_queue_delay_microseconds": 2000,
        "instance_count": 2,
        "max_num_seqs": "8",
        "max_num_batched_tokens": "2048",
        "num_kv_blocks": None,
        "kv_cache_memory_bytes": "536870912",
        "dtype": None,
        "quantization": None,
        "scheduling_policy": None,
    }
    assert batcher_settings(SERVED_CONFIGS["llm_continuous"])["batcher"] == "none: the model's own loop"
    iterative = {"max_batch_size": 8, "sequence_batching": {"iterative_sequence": True, "oldest": {
        "max_candidate_sequences": 8, "preferred_batch_size": [8], "max_queue_delay_microseconds": 0}}}
    assert batcher_settings(iterative)["batcher"] == "sequence (iterative)"
    assert batcher_settings(iterative)["max_queue_delay_microseconds"] == 0
    results = json.loads(FIXTURE.read_text())
    results["meta"]["configs"] = {model: batcher_settings(config) for model, config in SERVED_CONFIGS.items()}
    for run in results["runs"]:
        if run["model"] == "llm_dynamic":  # the KV pool as the engine reported it wins over the configured bytes
            run["metrics"] = [s for s in run["metrics"] if "llm_kv_blocks_total" not in s["values"]]
    report.build(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    table = md.split("## Configurations served")[1].split("\n\n")[1].splitlines()
    assert table[0] == (
        "| model | batcher | max_batch_size | preferred_batch_size | max_queue_delay | instances | max_num_seqs | "
        "max_num_batched_tokens | KV blocks | weights |"
    )
    assert table[2] == "| llm_dynamic | dynamic | 8 | 8 | 2 ms | 2 | 8 | 2048 | 512 MiB | bf16 |"
    assert table[3].startswith("| llm_continuous | none: the model's own loop | 0 | – | – | 1 | 8 | – | ")
    assert "Every model runs at most 8 sequences at once per instance (llm_dynamic: 2 instances)." in md


@pytest.mark.timeout(10)
def test_compare_serves_llm_dynamic_variants_beside_the_shipped_models(tmp_path):
    args = compare.parse_args(["--smoke", "--dynamic-variants", "3x4@50000,1x16@0"])
    assert [v.name for v in args.variants] == ["llm_dynamic_3x4_50000us", "llm_dynamic_1x16_0us"]
    models = args.models.split(",")
    assert models == ["llm_static", "llm_dynamic", "llm_dynamic_3x4_50000us", "llm_dynamic_1x16_0us",
                      "llm_iterative", "llm_continuous"]
    served = runner.served_repository(args.model_repository, tmp_path / "repo", models, args.variants)
    assert sorted(p.name for p in served.iterdir()) == sorted(models)
    config = config_text.load(served / "llm_dynamic_3x4_50000us" / "config.pbtxt")
    assert config.name == "llm_dynamic_3x4_50000us" and config.max_batch_size == 4
    assert [group.count for group in config.instance_group] == [3]
    assert config.dynamic_batching.max_queue_delay_microseconds == 50000
    assert config_text.parameter(config, "max_num_seqs") == "4"
    assert config_text.parameter(config, "num_threads") is not None  # three instances share the cores
    assert (served / "llm_dynamic_3x4_50000us" / "1" / "model.py").is_file()
    single = config_text.load(served / "llm_dynamic_1x16_0us" / "config.pbtxt")
    assert single.HasField("dynamic_batching") and single.dynamic_batching.max_queue_delay_microseconds == 0
    assert config_text.parameter(single, "num_threads") is None
    for model in ("llm_dynamic", "llm_continuous"):  # as shipped, but for the model folder the source meant
        shipped = config_text.load(REPO_ROOT / "model_repository" / model / "config.pbtxt")
        copy = config_text.load(served / model / "config.pbtxt")
        folder = config_text.parameter(shipped, "model")
        assert config_text.parameter(copy, "model") == str((REPO_ROOT / folder).resolve())
        copy.parameters["model"].string_value = folder
        assert copy == shipped

    # The default: the four models and llm_dynamic at its best; a running server: the four as it serves them.
    default = compare.parse_args([])
    assert default.models.split(",") == ["llm_static", "llm_dynamic",
                                         runner.DynamicVariant.parse(compare.BEST_DYNAMIC).name,
                                         "llm_iterative", "llm_continuous"]
    chosen = compare.parse_args(["--models", "llm_dynamic,llm_continuous", "--dynamic-variants", "2x4@2000"])
    assert chosen.models == "llm_dynamic,llm_dynamic_2x4_2000us,llm_continuous"
    running = compare.parse_args(["--url", "http://127.0.0.1:8000"])
    assert running.models == "llm_static,llm_dynamic,llm_iterative,llm_continuous" and running.variants == []
    for bad in (["--dynamic-variants", "0x8@2000"], ["--dynamic-variants", "2x8"],
                ["--dynamic-variants", "2x4@2000", "--url", "http://127.0.0.1:8000"],
                ["--dynamic-variants", "2x4@2000", "--models", "llm_continuous"]):
        with pytest.raises(SystemExit):
            compare.parse_args(bad)


@pytest.mark.timeout(60)
def test_report_builds_tables_and_plots_from_fixed_results(tmp_path):
    results = json.loads(FIXTURE.read_text())
    built = report.build(results, tmp_path)

    assert built["headline"].startswith("continuous vs dynamic at 4 users: 1.6x output tokens/s")
    assert "8.0x lower TTFT p99" in built["headline"]
    for name in (
        "throughput_vs_load",
        "latency_vs_load",
        "e2e_latency_cdf",
        "batch_size_over_time",
        "kv_blocks_over_time",
        "batch_size_histogram",
    ):
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 15_000, name

    md = (tmp_path / "report.md").read_text()
    table = md.split("## Every load point")[1].split("\n\n")[1].splitlines()
    assert table[0].startswith("| model | load | req/s | output tok/s | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50")
    assert [line.split(" | ")[:2] for line in table[2:]] == [
        ["| llm_dynamic", "2 users"],
        ["| llm_dynamic", "4 users"],
        ["| llm_continuous", "2 users"],
        ["| llm_continuous", "4 users"],
    ]
    assert "| 4 users | 1.59x |" in md  # the side-by-side table
    assert "Continuous beside static" not in md  # no llm_static runs, no table for it
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 6 and "<table>" in html and 'src="batch' not in html
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    dynamic4 = next(r for r in rows if r["model"] == "llm_dynamic" and r["users"] == 4)
    assert (
        dynamic4["num_failed"] == 0 and dynamic4["goodput_fraction"] == 0.0 and 2.5 < dynamic4["mean_batch_size"] < 3.5
    )


@pytest.mark.timeout(60)
def test_a_compare_run_records_what_its_report_prints(tmp_path):
    """record.json holds every load point's figures with the report's own columns, and a table written from it
    prints the cells the report prints."""
    results = json.loads(FIXTURE.read_text())
    built = report.build(results, tmp_path)
    record = Record("make compare", {"mode": "quick"}, {"commit": "c" * 40, "date": "2026-12-03", "cpu": {}})
    path = compare.write_record(record, built, results["meta"], tmp_path)
    kept = Record.read(path)
    table = kept.tables["load_points"]
    assert [c.header for c in table.columns] == [heading for heading, _, _ in report.COLUMNS]
    assert kept.settings["slo"] == results["meta"]["slo"] and kept.notes == [built["headline"]]
    printed = [" | ".join(c.cell(row) for c in table.columns) for row in table.rows]
    md = (tmp_path / "report.md").read_text()
    assert len(printed) == 4 and all(f"| {line} |" in md for line in printed)


@pytest.mark.timeout(10)
def test_report_html_is_its_markdown_rendered_with_the_images_inside(tmp_path):
    png = b"\x89PNG plot"
    (tmp_path / "plot.png").write_bytes(png)
    page = report.render_html(
        "# Title\n\n**Headline:** /v2/models/<model>/config & more\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
        "![a plot](plot.png)\n", tmp_path
    )
    assert "<h1>Title</h1>" in page and "<td>1</td>" in page
    assert "<strong>Headline:</strong> /v2/models/&lt;model&gt;/config &amp; more" in page  # text, not markup
    assert f'src="data:image/png;base64,{base64.b64encode(png).decode()}"' in page


@pytest.mark.timeout(60)
def test_report_puts_static_first_and_compares_continuous_with_it(tmp_path):
    results = json.loads(FIXTURE.read_text())
    dynamic = [run for run in results["runs"] if run["model"] == "llm_dynamic"]
    results["runs"] += [{**run, "model": "llm_static"} for run in dynamic]  # static measured as dynamic was
    built = report.build(results, tmp_path)
    assert built["headline"].startswith("continuous vs dynamic at 4 users: 1.6x output tokens/s")
    md = (tmp_path / "report.md").read_text()
    table = md.split("## Every load point")[1].split("\n\n")[1].splitlines()
    assert [line.split(" | ")[0] for line in table[2:]] == ["| llm_static"] * 2 + ["| llm_dynamic"] * 2 + [
        "| llm_continuous"
    ] * 2
    against_static = md.split("## Continuous beside static")[1]
    assert "goodput req/s (cont. vs static)" in against_static and "| 4 users | 1.59x |" in against_static
    assert "Static batching: the batcher waits for a full batch" in md


@pytest.mark.timeout(10)
def test_slo_verdict_names_what_broke():
    row = {"num_requests": 10, "num_failed": 0, "ttft_p99_ms": 2500.0, "tpot_p99_ms": 50.0}
    assert verdict(row, 2000, 100) == "TTFT p99 2.50 s > 2000 ms"
    assert verdict({**row, "ttft_p99_ms": 100.0}, 2000, 100) is None
    assert "3 failures" in verdict({**row, "num_failed": 3, "ttft_p99_ms": 100.0}, 2000, 100)


@pytest.mark.timeout(20)
def test_capacity_gives_the_paged_models_the_seats_their_kv_pool_holds(tmp_path):
    args = slo.parse_args(["--capacity", "--dynamic-variants", "1x16@2000"])
    assert args.models == "llm_dynamic_1x16_2000us,llm_iterative,llm_continuous"
    assert args.rates == slo.CAPACITY_RATES and args.duration == slo.CAPACITY_DURATION_S
    for bad in (["--capacity", "--url", "http://127.0.0.1:8000"], ["--dynamic-variants", "1x16@2000"]):
        with pytest.raises(SystemExit):
            slo.parse_args(bad)

    # The pool's blocks over the mean request's blocks.
    capacity = slo.capacity_seats(1456, 16, "long_tailed")
    assert capacity["kv_blocks"] == 1456 and capacity["block_size"] == 16
    spec = [make_request(get_workload("long_tailed"), i) for i in range(2000)]
    blocks = [-(-(r.num_prompt_words + r.max_tokens) // 16) for r in spec]  # ceil(tokens / block_size)
    assert capacity["mean_blocks"] == pytest.approx(sum(blocks) / 2000)
    assert capacity["seats"] == int(1456 // capacity["mean_blocks"]) < slo.MAX_CAPACITY_SEATS
    assert slo.capacity_seats(10**6, 16, "long_tailed")["seats"] == slo.MAX_CAPACITY_SEATS
    assert slo.capacity_seats(1, 16, "long_tailed")["seats"] == 1

    repo = slo.capacity_repository(REPO_ROOT / "model_repository", tmp_path / "repo", 96, args.variants)
    assert sorted(p.name for p in repo.iterdir()) == ["llm_continuous", "llm_dynamic_1x16_2000us", "llm_iterative"]
    iterative = config_text.load(repo / "llm_iterative" / "config.pbtxt")
    assert iterative.max_batch_size == 96 and iterative.sequence_batching.oldest.max_candidate_sequences == 96
    for model in ("llm_iterative", "llm_continuous"):
        assert config_text.parameter(config_text.load(repo / model / "config.pbtxt"), "max_num_seqs") == "96"


SERVED_METRICS = """\
# TYPE llm_kv_blocks_total gauge
llm_kv_blocks_total{model="llm_continuous",version="1",instance="llm_continuous_0"} 1456
llm_kv_blocks_total{model="llm_continuous",version="1",instance="llm_continuous_1"} 1500
llm_kv_blocks_total{model="llm_dynamic",version="1"} 7
"""


@pytest.mark.timeout(20)
def test_capacity_reads_the_kv_pool_from_a_server_of_llm_continuous(tmp_path, monkeypatch):
    """The pool is the server's: the blocks on its metrics port (one instance's), the block size in the config it
    serves; read from a server of llm_continuous alone, with the command line's engine parameters."""
    target = Target("http://127.0.0.1:1", "127.0.0.1:2", "http://127.0.0.1:3/metrics")
    served = {"parameters": {"block_size": {"string_value": "16"}, "max_num_seqs": {"string_value": "8"}}}
    asked = []
    monkeypatch.setattr(runner, "http_json", lambda url: asked.append(url) or served)
    monkeypatch.setattr(slo.prometheus, "scrape", lambda url, timeout=2.0: SERVED_METRICS)
    assert slo.served_kv_pool(target, "llm_continuous") == (1456, 16)
    assert asked == ["http://127.0.0.1:1/v2/models/llm_continuous/config"]
    with pytest.raises(RuntimeError, match="llm_kv_blocks_total"):
        slo.served_kv_pool(target, "llm_iterative", timeout_s=0.6)
    scrapes = iter(["", SERVED_METRICS])  # READY before the engine's loop set its gauges: asked again
    monkeypatch.setattr(slo.prometheus, "scrape", lambda url, timeout=2.0: next(scrapes))
    assert slo.served_kv_pool(target, "llm_continuous", timeout_s=5) == (1456, 16)
    served = {"parameters": {}}
    with pytest.raises(RuntimeError, match="block_size"):
        slo.served_kv_pool(target, "llm_continuous")

    serving = []

    @contextlib.contextmanager
    def serve(repository, model_folder, log_path):
        serving.append(repository)
        yield target

    monkeypatch.setattr(runner, "serve", serve)
    monkeypatch.setattr(slo, "served_kv_pool", lambda target, model: (1456, 16))
    args = slo.parse_args(["--capacity", "--quantization", "q4_1"])
    assert slo.size_capacity(args, tmp_path, say=lambda _: None) == slo.capacity_seats(1456, 16, "long_tailed")
    [repository] = serving
    assert sorted(p.name for p in repository.iterdir()) == ["llm_continuous"]
    assert config_text.parameter(config_text.load(repository / "llm_continuous" / "config.pbtxt"),
                                 "quantization") == "q4_1"


@pytest.mark.timeout(10)
def test_capacity_table_sets_continuous_beside_the_best_dynamic_configuration():
    def result(model, req_per_s, seats, instances=1, broke="3 req/s"):
        best = None if req_per_s is None else {
            "req_per_s": req_per_s, "load": f"{req_per_s:g} req/s", "output_tok_per_s": 100 * req_per_s,
            "ttft_p99_ms": 900.0, "tpot_p99_ms": 60.0}
        return {"model": model, "best": best, "first_violation": {"load": broke, "why": "TTFT p99 3.00 s > 2000 ms"},
                "rows": [{"load": "0.5 req/s"}], "config": {"instance_count": instances, "max_num_seqs": str(seats)}}

    results = [result("llm_dynamic_1x8_2000us", 0.5, 8), result("llm_dynamic_2x16_2000us", 1.0, 16, 2),
               result("llm_continuous", 4.0, 151, broke="6 req/s")]
    table = slo.capacity_table(results, 2000, 100)
    assert "| llm_dynamic_2x16_2000us | 2 x 16 | 1.00 | 1 req/s | 100 | 900 ms | 60 ms | 3 req/s: TTFT" in table
    assert table.endswith("llm_continuous sustains 4.00 req/s within the SLO; the best dynamic configuration "
                          "(llm_dynamic_2x16_2000us) 1.00: 4.0x.")
    none_held = slo.capacity_table([result("llm_dynamic", None, 8), results[2]], 2000, 100)
    assert "| llm_dynamic | 8 | – | none of the ladder | – |" in none_held
    assert none_held.endswith("no dynamic configuration held even the ladder's lowest load (0.5 req/s).")
    continuous_none = slo.capacity_table([results[0], result("llm_continuous", None, 151)], 2000, 100)
    assert continuous_none.endswith("llm_continuous sustains 0.00 req/s within the SLO; the best dynamic "
                                    "configuration (llm_dynamic_1x8_2000us) 0.50.")


def test_soak_shows_the_crash_when_the_server_dies(tmp_path):
    served = Served(tmp_path, model=None, out=tmp_path, exit_timeout=10)
    lines = ["I1129 started", "Signal (11) received.", " 0# 0x1 in tritonserver", " 1# 0x2 in libc.so.6"]
    served.server = SimpleNamespace(output_lines=lambda: lines)
    assert served.log_tail() == ["Signal (11) received.", " 0# 0x1 in tritonserver", " 1# 0x2 in libc.so.6"]
    lines = [f"line {i}" for i in range(30)]
    assert served.log_tail(count=3) == ["line 27", "line 28", "line 29"]


def test_the_models_a_forced_stop_ended_are_read_from_its_line():
    line = ("forced: tritonserver could not unload llm_static, llm_dynamic (most likely a request that Triton 2.51's "
            "gRPC frontend never released: ...); no request was open and their 2 stubs sat idle for 2 s")
    assert forced_models(line) == ("llm_dynamic", "llm_static")
    assert forced_models(None) == () and forced_models("drained in 0.2 s") == ()


def test_a_tritonserver_crash_is_named_and_the_known_grpc_frontend_one_told_apart():
    from backend.triton.launcher import crash
    from backend.triton.launcher.server_home import server_distribution

    binary = server_distribution()[0] / "bin" / "tritonserver"
    symbols = subprocess.run(["nm", "-C", str(binary)], capture_output=True, text=True, check=True).stdout
    address = {line.split(" ", 2)[2]: int(line.split()[0], 16) for line in symbols.splitlines() if line[:1] != " "}
    handler = address["triton::server::(anonymous namespace)::ErrorSignalHandler(int)"]
    process = next(a for name, a in address.items() if name.startswith("triton::server::grpc::ModelStreamInferHandler"
                                                                         "::Process("))
    elsewhere = next(a for name, a in address.items() if name.startswith("triton::server::HTTPAPIServer::"))
    base = 0x5618B9F7C000  # where the binary was loaded: any page-aligned address

    def stack(fault: int) -> list[str]:
        return ["Signal (11) received.", f" 0# 0x{base + handler + 0xBD:016X} in {binary}",
                " 1# 0x00007F0DB4E5A050 in /lib/x86_64-linux-gnu/libc.so.6",
                f" 2# 0x{base + fault + 0x3E:016X} in {binary}"]

    assert crash.crash_site(stack(process)).startswith("triton::server::grpc::ModelStreamInferHandler::Process(")
    assert crash.crash_site(stack(process)[:2]) is None and crash.crash_site(["Signal (11) received."]) is None
    log = ["I1205 12:23:05 started", "I1205 12:23:06 loaded", *stack(process), "I1205 pb_stub.cc Non-graceful"]
    assert crash.known_frontend_crash(log).startswith("triton::server::grpc::ModelStreamInferHandler::Process(")
    assert crash.crash_site(stack(elsewhere)).startswith("triton::server::HTTPAPIServer::")
    assert crash.known_frontend_crash(stack(elsewhere)) is None
    assert crash.known_frontend_crash(["I1205 12:23:05 started", "error: creating server: Internal"]) is None


# ---- the soak's accounting ----------------------------------------------------------------------------------------


def soak_client(num_requests: int, seconds: float = 60.0) -> soak_patterns.Client:
    target = soak_patterns.Target("127.0.0.1:1", "http://127.0.0.1:1", None, 5.0, 8, 100, 4)
    return soak_patterns.Client(0, target, "llm_dynamic", random.Random(0), soak_patterns.Budget(num_requests, seconds),
                                soak_patterns.Accounts())


def test_a_soak_budget_stops_at_its_count_and_at_its_deadline():
    budget = soak_patterns.Budget(5, 60.0)
    assert [budget.take(2), budget.take(2), budget.take(2), budget.take()] == [2, 2, 1, 0]
    assert soak_patterns.Budget(5, 0.0).take() == 0


def test_only_errors_that_say_why_are_not_lost():
    refusals = soak_patterns.SEQUENCE_REFUSALS
    assert soak_patterns.error_outcome("Exceeds maximum queue size") == ("error", "overloaded")
    # By the kind in front of the message, whatever its words say.
    overloaded = errors.message(ErrorKind.OVERLOADED, "reworded: the engine failed while running this request")
    assert soak_patterns.error_outcome(overloaded) == ("error", "overloaded")
    assert soak_patterns.error_outcome("the server is overloaded")[0] == "lost"  # no code: not a model's refusal
    multi = errors.message(ErrorKind.MULTI_REQUEST_SEQUENCE, "send one request per sequence")
    assert soak_patterns.error_outcome(multi, refusals) == ("error", "multi-request sequence")
    assert soak_patterns.error_outcome(multi)[0] == "lost"  # where no sequence was sent, it is not expected
    triton = "inference request for sequence 7 to model 'llm_iterative' must specify the START flag on the first " \
             "request of the sequence"
    assert soak_patterns.error_outcome(triton, refusals) == ("error", "sequence closed by Triton")
    assert soak_patterns.error_outcome(triton)[0] == "lost"
    assert soak_patterns.error_outcome(errors.message(ErrorKind.ENGINE_FAULT, "engine step failed"))[0] == "lost"
    openai_overloaded = SimpleNamespace(code=errors.HTTP[ErrorKind.OVERLOADED].code)
    assert soak_patterns.openai_error_outcome(openai_overloaded) == ("error", "overloaded")
    assert soak_patterns.openai_error_outcome(SimpleNamespace(code="internal_error"))[0] == "lost"
    assert soak_patterns.answer_outcome(8, "length", 8) == ("completed", "")
    assert soak_patterns.answer_outcome(7, "length", 8)[0] == "lost"
    assert soak_patterns.answer_outcome(8, "stop", 8)[0] == "lost"


def test_a_client_that_fails_mid_request_loses_that_request_and_goes_on():
    failed = []

    def pattern(client):
        for index in client.requests():
            if index == 1 and not failed:
                failed.append(index)
                raise ConnectionError("reset by peer")
            client.account("completed")

    client = soak_client(4)
    soak_patterns.play(pattern, client)
    assert client.accounts.counts == {"completed": 3, "lost": 1} and client.num_open == 0
    assert client.accounts.lost == ["client: ConnectionError: reset by peer"]

    def broken(client):
        raise RuntimeError("the OpenAI frontend is not running")

    client = soak_client(4)
    soak_patterns.play(broken, client)  # nothing sent: a failure of the client, not a lost request
    assert client.accounts.num_requests == 0 and client.accounts.failures


def soak_cell(**changes) -> dict:
    cell = {"requests": 8, "lost": 0, "completed": 8, "client_failures": [], "clients_still_running": 0,
            "full_batch_after": [8, 8], "after": {"nv_inference_pending_request_count": 0.0,
                                                  "llm_num_requests_running": 0.0, "llm_num_requests_waiting": 0.0,
                                                  "llm_kv_blocks_used": 0.0}}
    return {**cell, **changes}


@pytest.mark.parametrize(("cell", "failed"), [
    (soak_cell(), None),
    (soak_cell(lost=1), "no_request_lost"),
    (soak_cell(after={**soak_cell()["after"], "nv_inference_pending_request_count": 1.0}),
     "nothing_pending_in_triton_after_each_cell"),
    (soak_cell(after={**soak_cell()["after"], "llm_kv_blocks_used": float("nan")}),
     "kv_blocks_back_to_zero_after_each_cell"),
    (soak_cell(full_batch_after=[7, 8]), "full_batch_answered_after_each_cell"),
], ids=["ok", "lost", "pending", "kv-unknown", "seat-kept"])
def test_the_soak_verdict_fails_on_each_target(cell, failed):
    args = soak.parse_args(["--patterns", "http_generate", "--models", "llm_dynamic", "--clients", "8", "--rounds",
                            "1"])
    groups = soak_plan.plan(args.patterns, args.clients, args.models, 8, 8)
    stop = {"exit_status": 0, "exited_after_s": 2.0, "grace_s": 10.0, "frontend_exit": "not started",
            "forced_models": ["llm_dynamic"]}  # a forced unload is counted, not failed
    report = {"cells": [cell], "servers": [{"pattern": "http_generate", "clients": 8, "stop": stop,
                                            "rss": {"growth": None}}]}
    checks = soak.verdict(report, args, groups)
    assert [name for name, ok in checks.items() if not ok] == ([failed] if failed else [])
    report["servers"][0]["stop"] = {**stop, "exit_status": 1, "exited_after_s": 10.4}  # "Exit timeout expired"
    assert not soak.verdict(report, args, groups)["sigterm_exit_0_within_grace"]
    report["servers"][0] = {**report["servers"][0], "stop": stop, "died": -11}
    assert not soak.verdict(report, args, groups)["server_stayed_up"]


def test_a_load_generator_that_will_not_exit_is_killed_and_the_run_goes_on():
    """Locust has printed its summary and then hung at exit (a gRPC channel of a user stopped mid-stream): the
    runner asks it to stop, then kills it, so no load point leaves a process behind or stops the whole run."""
    import signal
    import sys
    import time

    from loadtest.runner import _wait_bounded

    ignores_sigterm = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); "
                       "time.sleep(60)")
    process = subprocess.Popen([sys.executable, "-c", ignores_sigterm], stdout=subprocess.PIPE)
    process.stdout.readline()  # its handler is in place
    started = time.monotonic()
    assert _wait_bounded(process, timeout_s=0.2, grace_s=0.3) == -signal.SIGKILL
    assert time.monotonic() - started < 10
    finishes = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert _wait_bounded(finishes, timeout_s=30) == 3


# ---- the mixed workload: interactive users beside batch users -------------------------------------------------------


@pytest.mark.timeout(10)
def test_the_mixed_workload_deals_each_model_its_interactive_users_first_and_each_class_its_own_requests():
    dealt = [deal_user(n, ["a", "b"], interactive_users=2) for n in range(8)]
    assert dealt == [("a", "interactive"), ("b", "interactive"), ("a", "interactive"), ("b", "interactive"),
                     ("a", "batch"), ("b", "batch"), ("a", "batch"), ("b", "batch")]
    assert {cls for _, cls in (deal_user(n, ["a"], 0) for n in range(4))} == {"batch"}
    mixed = get_workload("mixed")
    assert "mixed" in WORKLOAD_NAMES and "mixed" not in WORKLOADS  # make slo sizes single-class workloads only
    interactive = [make_request(mixed, i, 5, "interactive") for i in range(200)]
    batch = [make_request(mixed, i, 5, "batch") for i in range(200)]
    assert interactive == [make_request(mixed, i, 5, "interactive") for i in range(200)]  # a pure function
    assert make_request(mixed, 3, 5, "interactive") != make_request(mixed, 3, 6, "interactive")
    assert all(16 <= s.num_prompt_words <= 64 and 16 <= s.max_tokens <= 64 for s in interactive)
    assert all(256 <= s.num_prompt_words <= 512 and 128 <= s.max_tokens <= 384 for s in batch)
    assert [(c.name, c.priority, c.ttft_ms, c.tpot_ms) for c in mixed.classes] == [
        ("interactive", INTERACTIVE, 500.0, 100.0), ("batch", BATCH, None, None)]
    smoke = get_workload("mixed", 0.125)
    assert max(make_request(smoke, i, 0, "batch").max_tokens for i in range(50)) <= 48
    with pytest.raises(ValueError, match="no class 'chat'"):
        make_request(mixed, 0, 0, "chat")
    assert mixed.describe().startswith("mixed: interactive prompt 16-64 words, output 16-64 tokens; batch prompt")
    m = Measurement(4, 2, 10.0, traffic_class="interactive", priority=INTERACTIVE)
    assert (m.record()["class"], m.record()["priority"]) == ("interactive", 1)
    assert "class" not in Measurement(4, 2, 10.0).record()  # the other workloads' records as before


def classed(run: dict, every: int = 2) -> dict:
    """``run`` as a mixed workload's: every ``every``-th request interactive, the others batch jobs."""
    for i, r in enumerate(run["requests"]):
        r["class"] = "interactive" if i % every == 0 else "batch"
    return run


MIXED_CLASSES = [c.describe() for c in get_workload("mixed").classes]


@pytest.mark.timeout(10)
def test_each_class_is_summarized_on_its_own_with_the_interactive_share_within_its_targets():
    run = classed(steady_run(80, 20.0))  # 40 of each class, four tokens 100 ms apart: TTFT 50 ms, TPOT 100 ms
    for r in run["requests"][::4]:  # every other interactive request starts late
        r["ttft_ms"], r["token_ms"] = 900.0, [900.0, 1000.0, 1100.0, 1200.0]
    interactive, batch = stats.summarize_classes({**run, "priorities": True}, MIXED_CLASSES)
    assert (interactive["class"], interactive["num_requests"], interactive["priority"]) == ("interactive", 40, 1)
    # Its tokens that arrived in the window: all but three of the last late one's.
    assert interactive["output_tok_per_s"] == pytest.approx((40 * 4 - 3) / 20.0)
    assert (interactive["ttft_p50_ms"], interactive["ttft_p99_ms"]) == (pytest.approx(475.0), pytest.approx(900.0))
    assert interactive["within_targets"] == 0.5 and interactive["targets_met"] is False
    assert (batch["class"], batch["priority"], batch["ttft_p99_ms"]) == ("batch", 3, 50.0)
    assert batch["within_targets"] is None and batch["targets_met"] is None  # batch jobs have no target
    unprioritised = stats.summarize_classes(classed(steady_run(80, 20.0)), MIXED_CLASSES)
    assert [(r["priorities"], r["priority"], r["targets_met"]) for r in unprioritised] == [
        (False, None, True), (False, None, None)]
    # A class too sparse in the window says why, as a load point does.
    sparse, _ = stats.summarize_classes(classed(steady_run(60, 20.0), every=6), MIXED_CLASSES)
    assert sparse["not_measured"] == "10 requests in 20 s: too few to measure" and sparse["ttft_p99_ms"] is None


@pytest.mark.timeout(60)
def test_a_mixed_report_has_a_table_per_model_of_each_class_without_and_with_priorities(tmp_path):
    results = json.loads(FIXTURE.read_text())
    unprioritised = [classed(run) for run in results["runs"]]
    prioritised = [{**json.loads(json.dumps(run)), "priorities": True} for run in unprioritised]
    results["runs"] = unprioritised + prioritised
    results["meta"].update(classes=MIXED_CLASSES, interactive_users=2, priorities="both", configs={
        "llm_dynamic": {"batcher": "dynamic"}, "llm_continuous": {"scheduling_policy": "priority"}})
    built = report.build(results, tmp_path)

    md = (tmp_path / "report.md").read_text()
    section = md.split("## Interactive beside batch: each class, per model")[1].split("\n## ")[0]
    assert "2 interactive users at every load point" in section
    assert "targets TTFT p99 ≤ 500 ms and TPOT p99 ≤ 100 ms" in section
    assert "Run without priorities and with priorities" in section
    assert "(as served: llm_dynamic fcfs (the engine's default); llm_continuous priority)." in section
    assert "The other tables and plots of this report are of the runs without priorities." in section
    tables = {t.split("\n")[0]: t.split("\n\n")[1].splitlines() for t in section.split("### ")[1:]}
    assert list(tables) == ["llm_dynamic", "llm_continuous"]
    continuous = tables["llm_continuous"]
    assert continuous[0] == ("| load | priorities | class | requests | failures | output tok/s | TTFT p50 | TTFT p99 | "
                             "TPOT p50 | TPOT p99 | within targets | p99s on target |")
    assert [line.split(" | ")[:3] for line in continuous[2:]] == [
        ["| 2 users", "off", "interactive"], ["| 2 users", "off", "batch"],
        ["| 2 users", "on (level 1)", "interactive"], ["| 2 users", "on (level 3)", "batch"],
        ["| 4 users", "off", "interactive"], ["| 4 users", "off", "batch"],
        ["| 4 users", "on (level 1)", "interactive"], ["| 4 users", "on (level 3)", "batch"],
    ]
    assert continuous[3].endswith(" | – | – |") and continuous[5].endswith(" | – | – |")  # batch: no target
    assert continuous[6].split(" | ")[-2:] in (["100%", "yes |"], ["0%", "no |"]) or "no |" in continuous[6]
    # The rest of the report is the first pass's: one row per model and load, as before.
    assert len(built["rows"]) == 4 and len(built["class_rows"]) == 16
    assert [c.header for c in report.class_record_columns()][:4] == ["model", "load", "priorities", "class"]
    record = Record("make compare", {"mode": "quick"}, {"commit": "c" * 40, "date": "2026-12-03", "cpu": {}})
    kept = Record.read(compare.write_record(record, built, results["meta"], tmp_path))
    printed = [" | ".join(c.cell(row) for c in kept.tables["classes"].columns[1:]) for row in
               kept.tables["classes"].rows if row["model"] == "llm_continuous"]
    assert [f"| {line} |" for line in printed] == continuous[2:]
    # Another workload's report has no such section.
    plain = report.build(json.loads(FIXTURE.read_text()), tmp_path / "plain")
    assert "Interactive beside batch" not in (tmp_path / "plain" / "report.md").read_text()
    assert plain["class_rows"] == [] and "classes" not in Record.read(
        compare.write_record(Record("make compare", {}, {"commit": "c" * 40, "date": "", "cpu": {}}), plain,
                             results["meta"], tmp_path / "plain")).tables


@pytest.mark.timeout(30)
def test_compare_runs_the_mixed_workload_with_interactive_users_and_serves_priorities(tmp_path):
    args = compare.parse_args(["--smoke", "--workload", "mixed", "--priorities", "both", "--interactive-users", "3",
                               "--models", "llm_dynamic,llm_continuous", "--dynamic-variants", ""])
    plan, points = compare.make_plan(args)
    assert (plan.interactive_users, [p.users for p in points]) == (3, [4])  # --users counts the batch users
    assert runner.PRIORITY_PASSES[args.priorities] == (False, True)
    assert runner.engine_parameters(args) == {"scheduling_policy": "priority"}
    served = runner.repository_to_serve(args, tmp_path, args.models.split(","))
    assert config_text.parameter(config_text.load(served / "llm_dynamic" / "config.pbtxt"), "scheduling_policy") \
        == "priority"
    target = Target("http://h:1", "h:2", "http://h:3/metrics")
    command = runner.locust_command(target, "m", points[0], dataclasses.replace(plan, priorities=True), Path("r"),
                                    Path("c"))
    assert command[command.index("-u") + 1] == "7" and command[command.index("-r") + 1] == "7"
    assert command[command.index("--interactive-users") + 1] == "3" and "--priorities" in command
    unprioritised = runner.locust_command(target, "m", points[0], plan, Path("r"), Path("c"))
    assert "--priorities" not in unprioritised and "--interactive-users" in unprioritised
    plain_plan, plain_points = compare.make_plan(compare.parse_args(["--smoke"]))
    plain = runner.locust_command(target, "m", plain_points[0], plain_plan, Path("r"), Path("c"))
    assert "--interactive-users" not in plain and plain[plain.index("-u") + 1] == "4"
    assert runner.engine_parameters(compare.parse_args(["--smoke"])) == {}
    for bad in (["--priorities", "on"], ["--workload", "mixed", "--rates", "1"],
                ["--workload", "mixed", "--interactive-users", "-1"]):
        with pytest.raises(SystemExit):
            compare.parse_args(bad)
