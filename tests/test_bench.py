"""``backend.bench`` end to end on the tiny random Llama with the smallest settings: it runs and writes every key."""

from __future__ import annotations

import json

from backend import bench


def test_bench_runs_and_reports_documented_keys(tiny_llama_dir, tmp_path):
    settings = bench.BenchSettings(
        model=str(tiny_llama_dir), dtype="float32", threads=2, batches=(1, 2), hf_batches=(1,), prompt_len=8,
        new_tokens=4, repeats=1, workload_requests=6, workload_prompt_range=(4, 24), workload_short_range=(2, 4),
        workload_long_range=(8, 10), workload_long_share=0.3, workload_max_num_seqs=2, scheduler_seqs=8, quick=True,
    )
    result = bench.run_bench(settings, log=lambda msg: None)
    out = tmp_path / "bench.json"
    out.write_text(json.dumps(result))
    result = json.loads(out.read_text())

    assert set(result) == {"config", "fixed_batches", "workload", "scheduler"}
    rows = result["fixed_batches"]
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert {"batch", "engine_tok_s", "hf_tok_s", "ratio", "engine_decode_step_ms"} <= set(row)
        assert row["engine_tok_s"] > 0
    assert rows[0]["hf_tok_s"] > 0 and rows[0]["ratio"] > 0
    assert rows[1]["hf_tok_s"] is None and rows[1]["ratio"] is None  # skipped: not in hf_batches

    workload = result["workload"]
    for key in ("continuous_tok_s", "static_tok_s", "speedup", "continuous_mean_batch", "static_mean_batch",
                "fragmentation"):
        assert isinstance(workload[key], float), key
    assert 1 <= workload["static_mean_batch"] <= workload["continuous_mean_batch"] <= 2
    assert 0 <= workload["fragmentation"] < 1

    scheduler = result["scheduler"]
    assert {"us_per_step", "share_of_step", "step_ms", "step_source"} <= set(scheduler)
    assert scheduler["us_per_step"] > 0 and 0 < scheduler["share_of_step"] < 1

    assert "continuous / static" in bench.format_table(result)
