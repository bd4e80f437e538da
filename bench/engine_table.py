"""``make bench``'s table: one function per section, each reading the run's figures (the dict ``bench.engine``
returns and writes as JSON) and returning its lines."""

from __future__ import annotations

from pathlib import Path

from backend.contract.names import CONTINUOUS
from backend.kernels.weight_format import WeightFormat
from bench.engine_targets import TARGETS
from bench.engine_workload import PolicyRun, WorkloadComparison
from bench.mixed_steps import format_breakdown


def format_table(result: dict) -> str:
    """Every section, a blank line between two; the served and llama.cpp sections only when the run has them."""
    sections = [
        header(result), fixed_batches(result), memory_floor(result), served(result), llamacpp(result),
        workload(result), mixed_steps(result), scheduler(result), targets(result),
    ]
    return "\n\n".join("\n".join(lines) for lines in sections if lines)


def _or_dash(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _weights(result: dict) -> WeightFormat:
    return WeightFormat(result["config"].get("quantization") or WeightFormat.BF16)  # an older result: bf16


def _sampling(run: dict) -> str:
    return "greedy" if run["temperature"] == 0 else f"T={run['temperature']:g}"


def header(result: dict) -> list[str]:
    c = result["config"]
    return [f"model {c['model']}  weights {_weights(result)}  dtype {c['dtype']}  threads {c['threads']}"
            f"{'  (quick)' if c['quick'] else ''}"]


def fixed_batches(result: dict) -> list[str]:
    c, weights = result["config"], _weights(result)
    return [
        f"1. Fixed batches: {c['prompt_len']}-token prompts, exactly {c['new_tokens']} new tokens (greedy, ignore_eos)"
        + (f"; the engine on {weights} weights, HF generate on bf16" if weights.quantized else ""),
        f"   {'batch':>5}  {'engine tok/s':>12}  {'HF tok/s':>9}  {'ratio':>6}  {'engine decode step ms':>21}",
        *map(_fixed_batch_row, result["fixed_batches"]),
    ]


def _fixed_batch_row(row: dict) -> str:
    return (f"   {row['batch']:>5}  {row['engine_tok_s']:>12.1f}  {_or_dash(row['hf_tok_s'], '9.1f'):>9}  "
            f"{_or_dash(row['ratio'], '5.2f') + ('x' if row['ratio'] else ''):>6}  "
            f"{row['engine_decode_step_ms']:>21.1f}")


def memory_floor(result: dict) -> list[str]:
    f = result["memory_floor"]
    return [
        f"   Decode step against the memory floor (weights {f['weight_bytes'] / 1e6:.0f} MB and each sequence's cached"
        f" K/V, {f['mean_context']:.0f} tokens on average, read once per step at the measured "
        f"{f['bandwidth_gbs']:.1f} GB/s), and the step's sampling time (T=1 rows seeded per request):",
        f"   {'batch':>5}  {'floor ms':>8}  {'greedy step ms':>14}  {'x floor':>7}  {'decode tok/s':>12}  "
        f"{'T=1 step ms':>11}  {'sampling ms: greedy':>19}  {'T=1':>5}  {'T=1 top_p 0.9':>13}",
        *map(_floor_row, result["fixed_batches"]),
    ]


def _floor_row(row: dict) -> str:
    sample = row["sample_ms"]
    return (f"   {row['batch']:>5}  {row['floor_ms']:>8.1f}  {row['engine_decode_step_ms']:>14.1f}  "
            f"{row['step_over_floor']:>6.2f}x  {row['decode_tok_s']:>12.0f}  {row['sampled_decode_step_ms']:>11.1f}  "
            f"{sample['greedy']:>19.2f}  {sample['t1']:>5.2f}  {sample['t1_top_p']:>13.2f}")


def served(result: dict) -> list[str]:
    s = result["served"]
    if not s:
        return []
    lines = [
        f"2. Served: the same decode workloads through a real tritonserver ({_weights(result)} weights, gRPC "
        f"streaming, one stream per sequence, about {s['prompt_len']}-token prompts, {s['new_tokens']} new "
        "tokens), client in this process on the same cores",
        f"   {'model':>14}  {'batch':>5}  {'sampling':>8}  {'served ITL ms':>13}  {'offline step ms':>15}  "
        f"{'served / offline':>16}  {'ITL p90 ms':>10}  {'TTFT p50 ms':>11}  {'tokens/response':>15}  "
        f"{'client CPU':>10}  {'server CPU':>10}",
    ]
    for r in sorted(s["runs"], key=lambda r: (r["model"], r["batch"], r["temperature"])):
        lines.append(
            f"   {r['model']:>14}  {r['batch']:>5}  {_sampling(r):>8}  {r['itl_ms']:>13.1f}  "
            f"{r['offline_step_ms']:>15.1f}  {r['ratio']:>15.2f}x  {r['itl_p90_ms']:>10.1f}  "
            f"{_or_dash(r.get('ttft_ms'), '.1f'):>11}  {_or_dash(r.get('tokens_per_response'), '.2f'):>15}  "
            f"{r['client_cpu']:>10.0%}  {r['server_cpu']:>10.0%}"
        )
    return lines


def llamacpp(result: dict) -> list[str]:
    ll = result.get("llamacpp")
    if not ll:
        return []
    served_itl = {(r["batch"], r["temperature"]): r["itl_ms"] for r in (result["served"] or {}).get("runs", [])
                  if r["model"] == CONTINUOUS}
    lines = [
        f"2b. llama.cpp's llama-server ({ll['version']}) on {Path(ll['gguf']).name}: "
        f"{ll['prompt_len']}-token prompts (ids), {ll['new_tokens']} new tokens, {ll['threads']} threads, "
        f"{ll['num_slots']} slots, continuous batching, HTTP streaming, client in this process",
        f"   {'batch':>5}  {'sampling':>8}  {'llama.cpp ITL ms':>16}  {'ITL p90 ms':>10}  {'tok/s':>7}  "
        f"{'server ms/token':>16}  {'server CPU':>10}  {'served ITL ms':>13}  {'llama.cpp / served':>18}",
    ]
    for r in ll["runs"]:
        served_ms = served_itl.get((r["batch"], r["temperature"]))
        ratio = f"{r['itl_ms'] / served_ms:.2f}x" if served_ms else "-"
        lines.append(
            f"   {r['batch']:>5}  {_sampling(r):>8}  {r['itl_ms']:>16.1f}  {r['itl_p90_ms']:>10.1f}  "
            f"{r['tok_s']:>7.1f}  {_or_dash(r['server_ms_per_token'], '.1f'):>16}  {r['server_cpu']:>10.0%}  "
            f"{_or_dash(served_ms, '.1f'):>13}  {ratio:>18}"
        )
    lines.append("   served ITL: llm_continuous at the same batch and sampling (-: no served column in this run)")
    return lines


def workload(result: dict) -> list[str]:
    w = WorkloadComparison.from_json(result["workload"])
    return [
        f"3. Workload: {w.num_requests} requests at t=0, {w.num_prompt_tokens} prompt tokens, "
        f"{w.num_output_tokens} output tokens, max_num_seqs {w.max_num_seqs}",
        f"   {'policy':>10}  {'output tok/s':>12}  {'mean batch':>10}  {'steps':>6}  {'KV fragmentation':>16}"
        f"  {'prefill steps s':>15}  {'(steps, decode rows in them)':>28}  {'decode steps s':>14}",
        *(_policy_row(policy, run) for policy, run in w.runs()),
        f"   continuous / static: {w.speedup:.2f}x",
    ]


def _policy_row(policy: str, run: PolicyRun) -> str:
    steps_and_rows = f"({run.prefill_steps}, {run.prefill_step_decodes})"
    return (f"   {policy:>10}  {run.tok_s:>12.1f}  {run.mean_batch:>10.1f}  {run.num_steps:>6}  "
            f"{run.fragmentation:>16.1%}  {run.prefill_s:>15.1f}  {steps_and_rows:>28}  {run.decode_s:>14.1f}")


def mixed_steps(result: dict) -> list[str]:
    return [
        "3b. Mixed steps against their parts: a step carrying a fresh prompt chunk and N decodes, beside a step of "
        "the chunk alone plus a decode step of the N rows alone (real engine steps, arms alternating, medians)",
        *format_breakdown(result["mixed_steps"]),
    ]


def scheduler(result: dict) -> list[str]:
    sc = result["scheduler"]
    return [f"4. Scheduler: schedule + update with {sc['num_seqs']} running decodes: {sc['us_per_step']:.0f} us/step = "
            f"{sc['share_of_step']:.2%} of a {sc['step_ms']:.1f} ms step ({sc['step_source']})"]


def targets(result: dict) -> list[str]:
    lines = ["5. Speed targets, judged on this run's figures"]
    for t in result["targets"]:
        verdict = {True: "met", False: "MISSED", None: "not judged"}[t["met"]]
        detail = f" ({t['detail']})" if t["detail"] else ""
        lines.append(f"   {verdict:>10}  {t['name']}: {TARGETS[t['key']].format_value(t['value'])}, goal {t['goal']}"
                     f"{detail}")
    return lines
