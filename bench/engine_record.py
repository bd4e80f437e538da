"""``make bench``'s record: the figures its table prints (``bench/engine_table.py``), as the tables of a run's record
(``records/``), each figure beside its baseline from the same run: HF ``generate`` and the memory floor beside the
engine, the offline step beside the served stream, llama.cpp beside ``llm_continuous``, static beside continuous."""

from __future__ import annotations

from backend.contract.names import CONTINUOUS
from bench.engine_targets import TARGETS
from bench.engine_workload import WorkloadComparison
from records.record import Column, Record

FIXED_BATCHES = [
    Column("batch"), Column("engine_tok_s", "engine tok/s", "{:.1f}"), Column("hf_tok_s", "HF tok/s", "{:.1f}"),
    Column("ratio", "engine / HF", "{:.2f}x"), Column("engine_decode_step_ms", "decode step ms", "{:.1f}"),
    Column("floor_ms", "memory floor ms", "{:.1f}"), Column("step_over_floor", "x floor", "{:.2f}x"),
]
SERVED = [
    Column("model"), Column("batch"), Column("sampling"), Column("itl_ms", "served ITL ms", "{:.1f}"),
    Column("offline_step_ms", "offline step ms", "{:.1f}"), Column("ratio", "served / offline", "{:.2f}x"),
    Column("itl_p90_ms", "ITL p90 ms", "{:.1f}"), Column("ttft_ms", "TTFT p50 ms", "{:.1f}"),
]
LLAMACPP = [
    Column("batch"), Column("sampling"), Column("itl_ms", "llama.cpp ITL ms", "{:.1f}"),
    Column("served_itl_ms", f"served {CONTINUOUS} ITL ms", "{:.1f}"), Column("ratio", "llama.cpp / served", "{:.2f}x"),
    Column("tok_s", "llama.cpp tok/s", "{:.1f}"),
]
WORKLOAD = [
    Column("policy"), Column("tok_s", "output tok/s", "{:.1f}"), Column("mean_batch", "mean batch", "{:.1f}"),
    Column("steps"), Column("prefill_steps", "steps with prompt tokens"),
    Column("prefill_s", "time in them s", "{:.1f}"), Column("decode_s", "time in decode-only steps s", "{:.1f}"),
    Column("speedup", "continuous / static", "{:.2f}x"),
]
MIXED_STEPS = [
    Column("num_decodes", "decodes"), Column("chunk", "chunk tokens"),
    Column("decode_ms", "decodes alone ms", "{:.1f}"), Column("prefill_ms", "chunk alone ms", "{:.1f}"),
    Column("mixed_ms", "both in one step ms", "{:.1f}"),
    Column("ratio", "mixed / parts", "{:.2f}x"),
]
VERDICTS = {True: "met", False: "missed", None: "not judged"}
TARGETS_COLUMNS = [Column("name", "target"), Column("value", "this run"), Column("goal"), Column("verdict")]


def _sampling(run: dict) -> str:
    return "greedy" if run["temperature"] == 0 else f"T={run['temperature']:g}"


def add_tables(record: Record, result: dict) -> Record:
    record.add_table("fixed_batches", FIXED_BATCHES, [{c.key: row.get(c.key) for c in FIXED_BATCHES}
                                                      for row in result["fixed_batches"]])
    served_runs = (result.get("served") or {}).get("runs", [])
    if served_runs:
        record.add_table("served", SERVED, [
            {**{c.key: r.get(c.key) for c in SERVED}, "sampling": _sampling(r)}
            for r in sorted(served_runs, key=lambda r: (r["model"], r["batch"], r["temperature"]))])
    if result.get("llamacpp"):
        served_itl = {(r["batch"], r["temperature"]): r["itl_ms"] for r in served_runs if r["model"] == CONTINUOUS}
        rows = []
        for r in result["llamacpp"]["runs"]:
            served_ms = served_itl.get((r["batch"], r["temperature"]))
            rows.append({"batch": r["batch"], "sampling": _sampling(r), "itl_ms": r["itl_ms"],
                         "served_itl_ms": served_ms, "ratio": r["itl_ms"] / served_ms if served_ms else None,
                         "tok_s": r["tok_s"]})
        record.add_table("llamacpp", LLAMACPP, rows, title=f"llama.cpp {result['llamacpp']['version']}")
    w = WorkloadComparison.from_json(result["workload"])
    record.add_table("workload", WORKLOAD, [
        {"policy": policy, "tok_s": run.tok_s, "mean_batch": run.mean_batch, "steps": run.num_steps,
         "prefill_steps": run.prefill_steps, "prefill_s": run.prefill_s, "decode_s": run.decode_s,
         "speedup": w.speedup if policy == "continuous" else None}
        for policy, run in w.runs()])
    if result.get("mixed_steps"):
        record.add_table("mixed_steps", MIXED_STEPS, [{c.key: r[c.key] for c in MIXED_STEPS}
                                                      for r in result["mixed_steps"]])
    record.add_table("targets", TARGETS_COLUMNS, [
        {"name": t["name"], "value": TARGETS[t["key"]].format_value(t["value"]), "goal": t["goal"],
         "verdict": VERDICTS[t["met"]]} for t in result["targets"]])
    return record
