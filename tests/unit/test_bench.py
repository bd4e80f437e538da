"""``bench.engine`` end to end on the tiny random Llama with the smallest settings: it runs and writes every
key; and the served column's reading of the server's CPU time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import engine, engine_record, engine_table
from bench.engine_workload import PolicyRun, WorkloadComparison
from bench.served import _cpu_seconds
from records.record import Record


def test_bench_runs_and_reports_documented_keys(tiny_llama_dir, tmp_path):
    settings = engine.BenchSettings(
        model=str(tiny_llama_dir), dtype="float32", threads=2, batches=(1, 2), hf_batches=(1,), prompt_len=8,
        new_tokens=4, repeats=1, workload_requests=6, workload_prompt_range=(4, 24), workload_short_range=(2, 4),
        workload_long_range=(8, 10), workload_long_share=0.3, workload_max_num_seqs=2, scheduler_seqs=8, quick=True,
        served_models=("llm_continuous",), mixed_cases=((2, 8), (3, 40)), mixed_rounds=1,
    )
    result = engine.run_bench(settings, log=lambda msg: None)
    out = tmp_path / "bench.json"
    out.write_text(json.dumps(result))
    result = json.loads(out.read_text())

    assert set(result) == {"config", "fixed_batches", "memory_floor", "served", "workload", "mixed_steps", "scheduler",
                           "targets"}
    rows = result["fixed_batches"]
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert {"batch", "engine_tok_s", "hf_tok_s", "ratio", "engine_decode_step_ms", "sampled_decode_step_ms",
                "top_p_decode_step_ms", "decode_tok_s", "floor_ms", "step_over_floor"} <= set(row)
        assert row["engine_tok_s"] > 0
        assert set(row["sample_ms"]) == {"greedy", "t1", "t1_top_p"} and all(v > 0 for v in row["sample_ms"].values())
        assert 0 < row["floor_ms"] < row["engine_decode_step_ms"]  # nothing beats reading the weights once
    floor = result["memory_floor"]
    assert floor["bandwidth_gbs"] > 0 and floor["weight_bytes"] > 0 and floor["kv_bytes_per_token"] > 0
    assert rows[1]["floor_ms"] > rows[0]["floor_ms"]  # a second sequence reads its own K/V

    served = result["served"]["runs"]
    assert {(r["model"], r["batch"], r["temperature"]) for r in served} == {
        ("llm_continuous", b, t) for b in (1, 2) for t in (0.0, 1.0)}
    for run in served:
        assert run["itl_ms"] > 0 and run["ratio"] == run["itl_ms"] / run["offline_step_ms"]
        assert run["client_cpu"] >= 0 and run["server_cpu"] > 0  # to the nanosecond: a server that decoded used some
    targets = {t["name"]: t for t in result["targets"]}
    assert len(targets) == len(result["targets"]) and all(t["met"] in (True, False, None) for t in targets.values())
    assert rows[0]["hf_tok_s"] > 0 and rows[0]["ratio"] > 0
    assert rows[1]["hf_tok_s"] is None and rows[1]["ratio"] is None  # skipped: not in hf_batches

    workload = WorkloadComparison.from_json(result["workload"])
    assert workload.to_json() == result["workload"]
    for policy, run in workload.runs():
        assert isinstance(run.tok_s, float) and isinstance(run.mean_batch, float), policy
        assert isinstance(run.fragmentation, float), policy
    assert isinstance(workload.speedup, float)
    assert 1 <= workload.static.mean_batch <= workload.continuous.mean_batch <= 2
    assert 0 <= workload.continuous.fragmentation < 1

    assert workload.continuous.prefill_steps >= 1 and workload.continuous.prefill_step_decodes >= 0

    mixed = result["mixed_steps"]  # each arm checks that it ran the sequences and tokens it says
    assert [(r["num_decodes"], r["chunk"]) for r in mixed] == [(2, 8), (3, 40)]
    for row in mixed:
        assert row["parts_ms"] == row["decode_ms"] + row["prefill_ms"]
        assert row["ratio"] == row["mixed_ms"] / row["parts_ms"]
        assert set(row["phases"]) == {"decode", "prefill", "mixed"}

    scheduler = result["scheduler"]
    assert {"us_per_step", "share_of_step", "step_ms", "step_source"} <= set(scheduler)
    assert scheduler["us_per_step"] > 0 and 0 < scheduler["share_of_step"] < 1

    table = engine_table.format_table(result)
    assert "continuous / static" in table and "served / offline" in table and "x floor" in table
    assert "mixed / parts" in table
    assert "Speed targets, judged on this run's figures" in table

    record = engine_record.add_tables(Record("make bench", {}, {}), result)
    # no llama.cpp column here
    assert set(record.tables) == {"fixed_batches", "served", "workload", "mixed_steps", "targets"}
    assert len(record.tables["mixed_steps"].rows) == len(result["mixed_steps"])
    fixed = record.tables["fixed_batches"]
    assert [fixed.columns[0].cell(r) for r in fixed.rows] == ["1", "2"]
    assert [r["engine_decode_step_ms"] for r in fixed.rows] == [r["engine_decode_step_ms"] for r in rows]
    assert fixed.columns[2].cell(fixed.rows[1]) == "–"  # HF was not run at batch 2
    assert len(record.tables["served"].rows) == len(served)
    assert [r["policy"] for r in record.tables["workload"].rows] == ["continuous", "static"]
    assert [r["verdict"] for r in record.tables["targets"].rows] == [
        {True: "met", False: "missed", None: "not judged"}[t["met"]] for t in result["targets"]]


def test_the_workload_runs_each_policy_on_the_same_requests(tiny_llama_dir):
    settings = engine.BenchSettings(
        model=str(tiny_llama_dir), dtype="float32", threads=2, workload_requests=6, workload_prompt_range=(4, 24),
        workload_short_range=(2, 4), workload_long_range=(8, 10), workload_long_share=0.3, workload_max_num_seqs=2,
    )
    requests = engine.workload_requests(settings, vocab_size=256)
    runs = {policy: engine.run_workload(settings, policy, requests) for policy in ("continuous", "run_to_completion")}
    cont, stat = runs["continuous"], runs["run_to_completion"]
    assert cont.num_output_tokens == stat.num_output_tokens == sum(n for _, n in requests)  # ignore_eos
    assert 1 <= stat.mean_batch <= cont.mean_batch <= 2 and 0 <= cont.fragmentation < 1
    assert cont.prefill_steps >= 1 and cont.prefill_s + cont.decode_s > 0
    comparison = WorkloadComparison(len(requests), 2, sum(len(p) for p, _ in requests), cont, stat)
    assert comparison.speedup == cont.tok_s / stat.tok_s
    assert WorkloadComparison.from_json(json.loads(json.dumps(comparison.to_json()))) == comparison


def test_a_workload_of_the_older_flat_shape_reads_as_the_nested_one():
    flat = {"num_requests": 4, "num_prompt_tokens": 100, "num_output_tokens": 50, "max_num_seqs": 8,
            "continuous_tok_s": 100.0, "continuous_mean_batch": 4.0, "continuous_steps": 20, "fragmentation": 0.02,
            "static_tok_s": 50.0, "static_mean_batch": 2.0, "static_steps": 40, "static_fragmentation": 0.03,
            "speedup": 2.0, "continuous_prefill_s": 0.1, "continuous_decode_s": 0.4,
            "continuous_prefill_steps": 4, "continuous_prefill_step_decodes": 6}  # static's phases: not measured
    workload = WorkloadComparison.from_json(flat)
    assert workload.continuous == PolicyRun(100.0, 4.0, 20, 0.02, 50, 0.1, 0.4, 4, 6)
    assert workload.static == PolicyRun(50.0, 2.0, 40, 0.03, 50)
    assert (workload.speedup, workload.num_output_tokens) == (flat["speedup"], 50)
    nested = workload.to_json()
    assert nested["continuous"]["tok_s"] == 100.0 and nested["static"]["prefill_s"] is None
    assert WorkloadComparison.from_json(nested) == workload


# A process that, once started and told to on stdin, burns 2 ms of CPU on a thread that then ends, says so, and waits
# to be closed.
_BURN = """
import sys, threading, time

def burn():
    start = time.thread_time()
    while time.thread_time() - start < 0.002:
        pass

print("ready", flush=True)
sys.stdin.readline()
worker = threading.Thread(target=burn)
worker.start()
worker.join()
print("burnt", flush=True)
sys.stdin.readline()
"""


@pytest.mark.timeout(60)
def test_server_cpu_counts_what_a_clock_tick_misses():
    """2 ms of CPU, less than the 10 ms tick that /proc/PID/stat counts (a four-token run's server read 0.0 there),
    burnt by a thread that has ended before the second reading; a process that is gone counts 0."""
    child = subprocess.Popen([sys.executable, "-c", _BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        before = _cpu_seconds([child.pid])
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "burnt\n"
        after = _cpu_seconds([child.pid])
        assert 0.002 <= after - before < 30
    finally:
        child.kill()
        child.wait()
    assert _cpu_seconds([child.pid]) == 0.0
