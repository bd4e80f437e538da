"""Offline engine benchmark: the engine beside HF ``generate``, continuous beside static batching, scheduler cost.

    python -m backend.bench --model models/smollm2-135m-instruct [--quick] [--hf-batches 1,8,32] [--out reports/bench.json]

Prints one table from one run and writes the same figures to ``--out`` (JSON). Every figure has its baseline from
the same run beside it. Keys of the JSON file:

``config``
    what ran: ``model``, ``dtype``, ``threads``, ``quick``, ``repeats``, ``prompt_len``, ``new_tokens``, ``torch``,
    ``cpu_count``.
``fixed_batches`` (list, one entry per batch size)
    ``batch``; ``engine_tok_s`` (generated tokens / wall time of the whole ``generate``, prefill included);
    ``hf_tok_s`` (HF ``generate`` on the same prompts, same dtype and threads, static batch; ``null`` where skipped);
    ``ratio`` (``engine_tok_s / hf_tok_s`` or ``null``); ``engine_decode_step_ms`` (median decode step of the engine).
    Engine and HF alternate at each batch size and each keeps its best of ``config.repeats`` runs.
``workload``
    the same request mix (all at t=0, prompt and output lengths drawn with a fixed seed, ``ignore_eos``) run under
    both scheduling policies at the same ``max_num_seqs``: ``num_requests``, ``max_num_seqs``,
    ``num_prompt_tokens``, ``num_output_tokens``; ``continuous_tok_s``, ``static_tok_s`` (output tokens / wall time)
    and ``speedup`` (their ratio); ``continuous_mean_batch``, ``static_mean_batch`` (mean sequences per forward step,
    from ``StepRecord.num_seqs``); ``fragmentation`` and ``static_fragmentation`` (KV internal fragmentation,
    ``1 - sum(tokens in cache) / sum(blocks held * block_size)`` over running requests, summed over every step);
    ``continuous_prefill_s``, ``continuous_decode_s``, ``static_prefill_s``, ``static_decode_s`` (wall time in steps
    that carried prompt tokens, and in decode-only steps: where the time went).
``scheduler``
    ``num_seqs`` running decode sequences; ``us_per_step`` (``schedule()`` + ``update()``, pure Python, no model);
    ``step_ms`` (one real forward + sampling at that batch, ``step_source`` says how it was measured) and
    ``share_of_step`` (``us_per_step / step``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.block_manager import BlockManager
from backend.config import EngineConfig, SamplingParams
from backend.engine import LLMEngine
from backend.request import Request, RequestStatus
from backend.scheduler import Scheduler


@dataclass
class BenchSettings:
    model: str
    dtype: str = "bfloat16"
    threads: int = 2
    batches: tuple[int, ...] = (1, 8, 32, 64)
    hf_batches: tuple[int, ...] | None = None  # None: every batch in ``batches``
    prompt_len: int = 64
    new_tokens: int = 128
    workload_requests: int = 200
    workload_prompt_range: tuple[int, int] = (16, 512)
    workload_short_range: tuple[int, int] = (16, 64)
    workload_long_range: tuple[int, int] = (256, 512)
    workload_long_share: float = 0.1
    workload_max_num_seqs: int = 32
    scheduler_seqs: int = 256
    repeats: int = 2  # fixed batches: best of this many runs, engine and HF alike (the machine may be shared)
    seed: int = 0
    quick: bool = False

    @classmethod
    def quick_settings(cls, model: str, **overrides) -> BenchSettings:
        """About a minute: small batches, fewer and shorter requests."""
        values = dict(
            batches=(1, 8), new_tokens=32, workload_requests=40, workload_prompt_range=(16, 128),
            workload_long_range=(96, 128), workload_max_num_seqs=8, repeats=1, quick=True,
        )
        return cls(model=model, **{**values, **overrides})


# ---- 1. fixed batches: engine vs HF generate ----------------------------------------------------------------------


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(length)] for _ in range(num)]


def fixed_batches(s: BenchSettings, log=print) -> tuple[list[dict], float]:
    """Engine and HF tok/s per batch size, plus the engine's median decode step (ms) at the largest batch.

    Engine and HF runs alternate at each batch size and each keeps its best of ``s.repeats``, so both see the same
    background load on a shared machine.
    """
    biggest = max(s.batches)
    engine = LLMEngine(EngineConfig(
        model=s.model, dtype=s.dtype, num_threads=s.threads, max_num_seqs=biggest,
        max_num_batched_tokens=max(2048, biggest * s.prompt_len), max_model_len=s.prompt_len + s.new_tokens + 16,
        num_kv_blocks=biggest * -(-(s.prompt_len + s.new_tokens) // 16) + 16, seed=s.seed,
    ))
    vocab = engine.runner.shape.vocab_size
    hf_batches = set(s.batches if s.hf_batches is None else s.hf_batches)
    hf = HFGenerate(s) if hf_batches & set(s.batches) else None
    params = SamplingParams(max_tokens=s.new_tokens, temperature=0.0, ignore_eos=True)
    warm_up = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.generate(random_prompts(2, s.prompt_len, vocab, s.seed + 99), warm_up)
    rows, step_ms = [], 0.0
    for batch in s.batches:
        prompts = random_prompts(batch, s.prompt_len, vocab, s.seed + batch)
        engine_tok_s, hf_tok_s, step = 0.0, None, float("nan")
        for _ in range(s.repeats):
            first_step = engine.stats.num_steps
            start = time.perf_counter()
            outputs = engine.generate(prompts, params)
            elapsed = time.perf_counter() - start
            if sum(len(o.token_ids) for o in outputs) / elapsed > engine_tok_s:
                engine_tok_s = sum(len(o.token_ids) for o in outputs) / elapsed
                steps = engine.stats.recent_steps()[-(engine.stats.num_steps - first_step):]
                decode_steps = [r.times.total for r in steps if r.num_tokens == r.num_seqs == batch]
                step = statistics.median(decode_steps) * 1e3 if decode_steps else float("nan")
            if hf is not None and batch in hf_batches:
                hf_tok_s = max(hf_tok_s or 0.0, hf.tok_s(prompts, s.new_tokens))
        rows.append({
            "batch": batch, "engine_tok_s": engine_tok_s, "hf_tok_s": hf_tok_s,
            "ratio": engine_tok_s / hf_tok_s if hf_tok_s else None, "engine_decode_step_ms": step,
        })
        hf_text = f"HF {hf_tok_s:.1f} tok/s" if hf_tok_s else "HF skipped"
        log(f"      B={batch}: engine {engine_tok_s:.1f} tok/s (decode step {step:.1f} ms), {hf_text}")
        if batch == biggest:
            step_ms = step
    return rows, step_ms


class HFGenerate:
    """The baseline: HF transformers ``generate`` on a static batch, same dtype and threads as the engine."""

    def __init__(self, s: BenchSettings) -> None:
        from transformers import AutoModelForCausalLM

        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[s.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(s.model, dtype=dtype).eval()
        pad = self.model.config.pad_token_id
        self.pad = pad if pad is not None else 0
        self.tok_s(random_prompts(2, s.prompt_len, self.model.config.vocab_size, s.seed + 99), 4)  # warm-up

    def tok_s(self, prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=self.pad,
            )
        return len(prompts) * new_tokens / (time.perf_counter() - start)


# ---- 2. variable workload: continuous vs static -------------------------------------------------------------------


def workload_requests(s: BenchSettings, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt ids, output length): prompts uniform in the prompt range; outputs mostly short, a long tail."""
    rng = random.Random(s.seed)
    requests = []
    for _ in range(s.workload_requests):
        prompt_len = rng.randint(*s.workload_prompt_range)
        long = rng.random() < s.workload_long_share
        output_len = rng.randint(*(s.workload_long_range if long else s.workload_short_range))
        requests.append(([rng.randrange(100, vocab_size - 100) for _ in range(prompt_len)], output_len))
    return requests


def run_workload(s: BenchSettings, policy: str, requests: list[tuple[list[int], int]]) -> dict:
    longest = s.workload_prompt_range[1] + max(s.workload_long_range[1], s.workload_short_range[1])
    engine = LLMEngine(EngineConfig(
        model=s.model, dtype=s.dtype, num_threads=s.threads, max_num_seqs=s.workload_max_num_seqs,
        max_model_len=longest + 16, scheduling_policy=policy, seed=s.seed,
    ))
    for i, (prompt, output_len) in enumerate(requests):
        engine.add_request(f"w{i}", prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    block_size = engine.config.block_size
    num_seqs: list[int] = []
    tokens_in_cache = slots_held = 0
    busy = prefill_busy = 0.0
    while engine.has_unfinished():
        num_steps = engine.stats.num_steps
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        busy += elapsed
        if engine.stats.num_steps == num_steps:
            continue  # nothing was scheduled
        record = engine.stats.steps[-1]
        num_seqs.append(record.num_seqs)
        if record.num_tokens > record.num_seqs:  # the step carried prompt tokens
            prefill_busy += elapsed
        # Sampled after each step, over the requests that hold blocks (outside the timed region).
        running = engine.scheduler.running
        tokens_in_cache += sum(r.num_computed_tokens for r in running)
        slots_held += sum(len(r.block_ids) for r in running) * block_size
    generated = engine.stats.num_generation_tokens
    del engine
    return {
        "tok_s": generated / busy,
        "mean_batch": statistics.fmean(num_seqs),
        "fragmentation": 1 - tokens_in_cache / slots_held if slots_held else 0.0,
        "num_output_tokens": generated,
        "num_steps": len(num_seqs),
        "prefill_s": prefill_busy,
        "decode_s": busy - prefill_busy,
    }


# ---- 3. scheduler cost --------------------------------------------------------------------------------------------


def scheduler_us_per_step(num_seqs: int, steps: int = 200, block_size: int = 16) -> float:
    """schedule() + update() with ``num_seqs`` running decodes; a fake model returns token 7 for everyone."""
    config = EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs), max_model_len=4096)
    pool = BlockManager(num_seqs * (4096 // block_size), block_size)
    scheduler = Scheduler(config, pool, 4096)
    params = SamplingParams(max_tokens=3000, ignore_eos=True)
    for i in range(num_seqs):
        request = Request(f"s{i}", [1 + (i + j) % 1000 for j in range(64)], params)
        scheduler.add_request(request)
    sched = scheduler.schedule()  # admits everyone: a prefill step
    scheduler.update(sched, {s.request.request_id: 7 for s in sched.scheduled})
    timings = []
    for _ in range(steps):
        start = time.perf_counter()
        sched = scheduler.schedule()
        tokens = {s.request.request_id: 7 for s in sched.scheduled}
        scheduler.update(sched, tokens)
        timings.append(time.perf_counter() - start)
    if len(sched.scheduled) != num_seqs or any(r.status is not RequestStatus.RUNNING for r in scheduler.running):
        raise RuntimeError("the scheduler benchmark lost sequences; it no longer measures what it says")
    return statistics.median(timings) * 1e6


def real_step_ms(s: BenchSettings, num_seqs: int, context: int = 64, repeats: int = 3) -> float:
    """One real decode forward + sampling at ``num_seqs`` sequences of ``context`` tokens.

    The KV cache holds zeros rather than a real prefill (its contents do not change the cost), which avoids
    prefilling ``num_seqs * context`` tokens first.
    """
    engine = LLMEngine(EngineConfig(
        model=s.model, dtype=s.dtype, num_threads=s.threads, max_num_seqs=num_seqs,
        max_num_batched_tokens=max(2048, num_seqs), max_model_len=context + 16,
        num_kv_blocks=num_seqs * -(-(context + 1) // 16) + 1,
    ))
    bs = engine.config.block_size
    vocab = engine.runner.shape.vocab_size
    requests = []
    for i, prompt in enumerate(random_prompts(num_seqs, context, vocab, s.seed)):
        r = Request(f"d{i}", prompt + [prompt[0]])
        r.num_computed_tokens = context
        r.block_ids = list(range(i * -(-(context + 1) // bs), (i + 1) * -(-(context + 1) // bs)))
        requests.append(r)
    params = [r.sampling_params for r in requests]
    ids = [r.request_id for r in requests]
    timings = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        inputs = engine.runner.prepare([(r, 1) for r in requests])
        engine.sampler(engine.runner.run(inputs), ids, params)
        timings.append(time.perf_counter() - start)
    del engine
    return statistics.median(timings[1:]) * 1e3


# ---- the whole run ------------------------------------------------------------------------------------------------


def run_bench(s: BenchSettings, log=print) -> dict:
    """Run all three parts and return the JSON-ready figures (keys documented in the module docstring)."""
    torch.set_num_threads(s.threads)
    log(f"[1/3] fixed batches {list(s.batches)}: engine and HF generate, best of {s.repeats} ...")
    engine_rows, biggest_step_ms = fixed_batches(s, log)

    log(f"[2/3] workload: {s.workload_requests} requests, continuous vs static ...")
    vocab = json.loads((Path(s.model) / "config.json").read_text())["vocab_size"]
    requests = workload_requests(s, vocab)
    cont = run_workload(s, "continuous", requests)
    log(f"      continuous: {cont['tok_s']:.1f} tok/s, mean batch {cont['mean_batch']:.1f}")
    stat = run_workload(s, "static", requests)
    log(f"      static: {stat['tok_s']:.1f} tok/s, mean batch {stat['mean_batch']:.1f}")
    workload = {
        "num_requests": len(requests),
        "max_num_seqs": s.workload_max_num_seqs,
        "num_prompt_tokens": sum(len(p) for p, _ in requests),
        "num_output_tokens": cont["num_output_tokens"],
        "continuous_tok_s": cont["tok_s"],
        "static_tok_s": stat["tok_s"],
        "speedup": cont["tok_s"] / stat["tok_s"],
        "continuous_mean_batch": cont["mean_batch"],
        "static_mean_batch": stat["mean_batch"],
        "continuous_steps": cont["num_steps"],
        "static_steps": stat["num_steps"],
        "fragmentation": cont["fragmentation"],
        "static_fragmentation": stat["fragmentation"],
        "continuous_prefill_s": cont["prefill_s"],
        "continuous_decode_s": cont["decode_s"],
        "static_prefill_s": stat["prefill_s"],
        "static_decode_s": stat["decode_s"],
    }

    log(f"[3/3] scheduler cost at {s.scheduler_seqs} sequences ...")
    us = scheduler_us_per_step(s.scheduler_seqs)
    step_ms = real_step_ms(s, s.scheduler_seqs)
    scheduler = {
        "num_seqs": s.scheduler_seqs,
        "us_per_step": us,
        "step_ms": step_ms,
        "step_source": f"one real decode forward + sampling at batch {s.scheduler_seqs}, 64-token contexts",
        "share_of_step": us / (step_ms * 1e3),
        "largest_fixed_batch_step_ms": biggest_step_ms,
    }
    config = {
        "model": s.model, "dtype": s.dtype, "threads": s.threads, "quick": s.quick, "repeats": s.repeats,
        "prompt_len": s.prompt_len,
        "new_tokens": s.new_tokens, "torch": torch.__version__, "cpu_count": os.cpu_count(),
    }
    return {"config": config, "fixed_batches": engine_rows, "workload": workload, "scheduler": scheduler}


def format_table(result: dict) -> str:
    c, w, sc = result["config"], result["workload"], result["scheduler"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = [
        f"model {c['model']}  dtype {c['dtype']}  threads {c['threads']}{'  (quick)' if c['quick'] else ''}",
        "",
        f"1. Fixed batches: {c['prompt_len']}-token prompts, exactly {c['new_tokens']} new tokens (greedy, ignore_eos)",
        f"   {'batch':>5}  {'engine tok/s':>12}  {'HF tok/s':>9}  {'ratio':>6}  {'engine decode step ms':>21}",
    ]
    for row in result["fixed_batches"]:
        lines.append(
            f"   {row['batch']:>5}  {row['engine_tok_s']:>12.1f}  {fmt(row['hf_tok_s'], '9.1f'):>9}  "
            f"{fmt(row['ratio'], '5.2f') + ('x' if row['ratio'] else ''):>6}  {row['engine_decode_step_ms']:>21.1f}"
        )
    lines += [
        "",
        f"2. Workload: {w['num_requests']} requests at t=0, {w['num_prompt_tokens']} prompt tokens, "
        f"{w['num_output_tokens']} output tokens, max_num_seqs {w['max_num_seqs']}",
        f"   {'policy':>10}  {'output tok/s':>12}  {'mean batch':>10}  {'steps':>6}  {'KV fragmentation':>16}"
        f"  {'prefill steps s':>15}  {'decode steps s':>14}",
        f"   {'continuous':>10}  {w['continuous_tok_s']:>12.1f}  {w['continuous_mean_batch']:>10.1f}  "
        f"{w['continuous_steps']:>6}  {w['fragmentation']:>16.1%}  {w['continuous_prefill_s']:>15.1f}"
        f"  {w['continuous_decode_s']:>14.1f}",
        f"   {'static':>10}  {w['static_tok_s']:>12.1f}  {w['static_mean_batch']:>10.1f}  "
        f"{w['static_steps']:>6}  {w['static_fragmentation']:>16.1%}  {w['static_prefill_s']:>15.1f}"
        f"  {w['static_decode_s']:>14.1f}",
        f"   continuous / static: {w['speedup']:.2f}x",
        "",
        f"3. Scheduler: schedule + update with {sc['num_seqs']} running decodes: {sc['us_per_step']:.0f} us/step = "
        f"{sc['share_of_step']:.2%} of a {sc['step_ms']:.1f} ms step ({sc['step_source']})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a reduced run of about a minute (smoke test)")
    parser.add_argument("--batches", help="comma-separated fixed batch sizes (default 1,8,32,64; quick 1,8)")
    parser.add_argument("--hf-batches", help="comma-separated batch sizes at which to run HF generate (default all)")
    parser.add_argument("--repeats", type=int, help="fixed batches: best of N runs, engine and HF alike (default 2)")
    parser.add_argument("--out", default="reports/bench.json")
    args = parser.parse_args(argv)
    overrides = {"dtype": args.dtype, "threads": args.threads}
    if args.batches:
        overrides["batches"] = tuple(int(b) for b in args.batches.split(","))
    if args.repeats:
        overrides["repeats"] = args.repeats
    if args.hf_batches is not None:
        overrides["hf_batches"] = tuple(int(b) for b in args.hf_batches.split(",") if b)
    settings = (BenchSettings.quick_settings if args.quick else BenchSettings)(model=args.model, **overrides)
    result = run_bench(settings, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
