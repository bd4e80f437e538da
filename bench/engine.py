"""Engine benchmark: the engine beside HF ``generate`` and beside its memory floor, served through a real
tritonserver beside offline, continuous beside static batching, scheduler cost, and the speed targets judged.

    python -m bench.engine --model models/smollm2-135m-instruct [--quick] [--hf-batches 1,8,32]
        [--served-models llm_continuous,llm_dynamic] [--llamacpp .llamacpp/bin/llama-server] [--out reports/bench.json]
        [--quantization q4_1] [--llamacpp-gguf .llamacpp/smollm2-135m-instruct-q4_1.gguf]

``--quantization`` (``bf16``, the default, ``q4_1`` or ``int8``) is the weight format of every engine run here and of
the served column (the engine parameter ``quantization``); HF ``generate``, the fixed batches' baseline, keeps the
bf16 weights. The llama.cpp column serves the GGUF of the same format that ``make llamacpp`` puts beside its server
(``<model>-q4_1.gguf`` for q4_1, ``<model>-bf16.gguf`` otherwise), or the one ``--llamacpp-gguf`` names.

Prints one table from one run (``bench/engine_table.py``) and writes the same figures to ``--out`` (JSON). Every
figure has its baseline from the same run beside it; the targets are judged on them (``bench/engine_targets.py``).
This module measures. Keys of the JSON file:

``config``
    what ran: ``model``, ``dtype``, ``quantization`` (the weight format: ``bf16``, ``q4_1`` or ``int8``), ``threads``,
    ``quick``, ``repeats``, ``prompt_len``, ``new_tokens``, ``torch``, ``cpu_count``.
``fixed_batches`` (list, one entry per batch size)
    ``batch``; ``engine_tok_s`` (generated tokens / wall time of the whole ``generate``, prefill included);
    ``hf_tok_s`` (HF ``generate`` on the same prompts, same dtype and threads, static batch; ``null`` where skipped);
    ``ratio`` (``engine_tok_s / hf_tok_s`` or ``null``); ``engine_decode_step_ms`` (median decode step of the engine).
    Engine and HF alternate at each batch size and each keeps its best of ``config.repeats`` runs.
    Sampled runs of the same prompts (each request seeded): ``sampled_decode_step_ms`` (temperature 1.0),
    ``top_p_decode_step_ms`` (temperature 1.0, top_p 0.9); ``sample_ms`` (median time per decode step spent in the
    sampler: ``greedy``, ``t1``, ``t1_top_p``); ``decode_tok_s`` (``batch`` / greedy decode step);
    ``floor_ms`` (the memory floor at this batch) and ``step_over_floor`` (greedy decode step / floor).
``memory_floor``
    ``bandwidth_gbs`` (best read bandwidth of ``threads`` threads summing a 1 GiB buffer), ``weight_bytes`` (every
    weight read once per step, LM head included; quantized: as the engine holds them), ``kv_bytes_per_token`` (K and
    V of one token, all layers), ``mean_context`` (the fixed batches' mean context) and ``step_ms`` (batch -> the
    time to read the weights and every sequence's cached K/V at that bandwidth: no decode step can be faster).
``served`` (``null`` with ``--served-models ''``)
    the fixed batches' decode workloads through a real tritonserver: ``models``, ``new_tokens``, ``prompt_len``,
    ``quantization`` (null: bf16); ``runs``, one per model, batch and ``temperature`` (0 or 1): ``itl_ms`` (median
    inter-token gap of the streams, best of ``config.repeats``; a response of k tokens counts as k gaps),
    ``itl_p90_ms``, ``tok_s``, ``ttft_ms`` (median over the streams), ``tokens_per_response`` (``stream_interval`` at
    work), ``client_cpu`` and ``server_cpu`` (cores used by this process as the client and by tritonserver with its
    stubs), ``offline_step_ms`` (the fixed batches' median decode step at that batch and sampling) and ``ratio``
    (``itl_ms / offline_step_ms``). See ``bench/served.py``.
``llamacpp`` (only with ``--llamacpp PATH``: llama.cpp's ``llama-server``, built by ``make llamacpp``)
    the same decode workloads (random prompts of ``prompt_len`` token ids) through ``llama-server`` on the GGUF of the
    same weights (BF16, or Q4_1 with ``--quantization q4_1``, or ``--llamacpp-gguf``), HTTP streaming
    ``/completion``: ``server``, ``version``, ``gguf``, ``command``, ``threads``, ``num_slots``, ``prompt_len``,
    ``new_tokens``; ``runs``, one per batch and ``temperature`` (0 or 1): ``itl_ms``, ``itl_p90_ms`` and ``tok_s``
    measured on the client as for ``served`` (best of ``config.repeats``), ``server_ms_per_token`` (llama.cpp's own
    ``predicted_per_token_ms``, median over the streams) and ``server_cpu``.
    See ``bench/llamacpp.py``.
``targets``
    the speed targets: ``key`` (its entry in ``bench.engine_targets.TARGETS``: limit, moonshot, meaning), ``name``,
    ``value`` (``null`` if not measured), ``goal``, ``met`` (``null``: not judged), ``detail``.
``workload``
    the same request mix (all at t=0, prompt and output lengths drawn with a fixed seed, ``ignore_eos``) run under
    both scheduling policies at the same ``max_num_seqs``: ``num_requests``, ``max_num_seqs``,
    ``num_prompt_tokens``, ``num_output_tokens``, ``speedup`` (continuous / static output tokens/s), and one object
    per policy, ``continuous`` and ``static``: ``tok_s`` (output tokens / wall time), ``mean_batch`` (mean sequences
    per forward step, from ``StepRecord.num_seqs``), ``num_steps``, ``fragmentation`` (KV internal fragmentation,
    ``1 - sum(tokens in cache) / sum(blocks held * block_size)`` over running requests, summed over every step),
    ``num_output_tokens``, ``prefill_s`` and ``decode_s`` (wall time in steps that carried prompt tokens, and in
    decode-only steps: where the time went), ``prefill_steps`` (how many steps carried prompt tokens) and
    ``prefill_step_decodes`` (the decode rows those steps carried beside their chunks: a step carrying a chunk also
    pays for them). See ``bench/engine_workload.py``, which also reads a result of the older flat shape
    (``continuous_tok_s``, ``static_tok_s``, ...).
``mixed_steps`` (list, one entry per case of ``mixed_cases``)
    a step carrying a fresh prompt chunk and N decodes against a step of that chunk alone plus a decode step of the N
    rows alone, each a real engine step, the arms alternating: ``num_decodes``, ``chunk``, ``context`` (the decodes'
    context), ``rounds``, ``decode_ms``, ``prefill_ms``, ``mixed_ms`` (median whole steps), ``parts_ms`` (decode +
    prefill), ``ratio`` (mixed / parts) and ``phases`` (arm -> prepare / forward / sample ms). See
    ``bench/mixed_steps.py``.
``scheduler``
    ``num_seqs`` running decode sequences; ``us_per_step`` (``schedule()`` + ``update()``, pure Python, no model);
    ``step_ms`` (one real forward + sampling at that batch, ``step_source`` says how it was measured) and
    ``share_of_step`` (``us_per_step / step``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import torch  # noqa: E402

from backend.contract.settings import DEFAULT_MODEL  # noqa: E402
from backend.engine.block_manager import BlockManager  # noqa: E402
from backend.engine.config import WEIGHT_FORMATS, EngineConfig, ModelShape  # noqa: E402
from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.engine.request import Request, RequestStatus  # noqa: E402
from backend.engine.sampling_params import SamplingParams  # noqa: E402
from backend.engine.scheduler import ScheduledRequest, Scheduler  # noqa: E402
from backend.engine.stats import StepRecord  # noqa: E402
from backend.kernels.weight_format import WeightFormat  # noqa: E402
from bench.engine_record import add_tables  # noqa: E402
from bench.engine_table import format_table  # noqa: E402
from bench.engine_targets import judge_targets  # noqa: E402
from bench.engine_workload import PolicyRun, WorkloadComparison  # noqa: E402
from bench.engines import (  # noqa: E402
    blocks_for,
    build_engine,
    fixed_batch_engine,
    held_weight_bytes,
    median_ms,
    random_prompts,
    timed_generate,
)
from bench.llamacpp import llamacpp_column  # noqa: E402
from bench.mixed_steps import mixed_step_breakdown  # noqa: E402
from bench.served import SERVED_MODELS, served_column  # noqa: E402
from records.provenance import read_bandwidth_gbs  # noqa: E402
from records.record import Record  # noqa: E402


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
    # (decodes, prompt chunk) of the mixed-step breakdown: the burst workload's steps carry about 30 decodes beside a
    # prompt of 16-512 tokens (a few prompts: up to the 2048-token budget)
    mixed_cases: tuple[tuple[int, int], ...] = ((16, 256), (31, 256), (16, 1024), (31, 1024))
    mixed_rounds: int = 5
    repeats: int = 2  # fixed batches: best of this many runs, engine and HF alike (the machine may be shared)
    seed: int = 0
    quick: bool = False
    served_models: tuple[str, ...] = SERVED_MODELS  # the served column's models; () skips it
    llamacpp: str | None = None  # llama.cpp's llama-server for its column; None skips it
    llamacpp_gguf: str | None = None  # the GGUF it serves; None: the one of this format beside it (default_gguf)
    quantization: WeightFormat | None = None  # the engines' weights (EngineConfig.quantization); None: bf16

    @property
    def weight_format(self) -> WeightFormat:
        return self.quantization or WeightFormat.BF16

    def engine(self, **settings) -> LLMEngine:
        """An engine on these settings' model, weights, dtype and threads, with the other ``settings`` as given."""
        return build_engine(self.model, self.quantization, dtype=self.dtype, num_threads=self.threads, **settings)

    @classmethod
    def quick_settings(cls, model: str, **overrides) -> BenchSettings:
        """About a minute: small batches, fewer and shorter requests."""
        values = dict(
            batches=(1, 8), new_tokens=32, workload_requests=40, workload_prompt_range=(16, 128),
            workload_long_range=(96, 128), workload_max_num_seqs=8, repeats=1, quick=True,
            mixed_cases=((8, 64), (8, 256)), mixed_rounds=3,
        )
        return cls(model=model, **{**values, **overrides})


# ---- 1. fixed batches: engine vs HF generate ----------------------------------------------------------------------


# Each fixed batch also runs sampled (one seed per request): temperature 1.0 (the served default), and with top-p.
SAMPLED_RUNS = {"t1": {"temperature": 1.0}, "t1_top_p": {"temperature": 1.0, "top_p": 0.9}}


def fixed_batches(s: BenchSettings, log=print) -> tuple[list[dict], float, int]:
    """Engine and HF tok/s per batch size, the engine's decode step greedy and sampled with the time it spent
    sampling, plus the engine's median decode step (ms) at the largest batch and the bytes of its weights as held.

    Engine and HF runs alternate at each batch size and each keeps its best of ``s.repeats``, so both see the same
    background load on a shared machine.
    """
    biggest = max(s.batches)
    engine = fixed_batch_engine(s.model, s.quantization, biggest, s.prompt_len, s.new_tokens, dtype=s.dtype,
                                num_threads=s.threads, seed=s.seed)
    vocab = engine.runner.shape.vocab_size
    hf_batches = set(s.batches if s.hf_batches is None else s.hf_batches)
    hf = HFGenerate(s) if hf_batches & set(s.batches) else None
    params = SamplingParams(max_tokens=s.new_tokens, temperature=0.0, ignore_eos=True)
    rows, step_ms = [], 0.0
    for batch in s.batches:
        prompts = random_prompts(batch, s.prompt_len, vocab, s.seed + batch)
        sampled_params = {
            name: [SamplingParams(max_tokens=s.new_tokens, ignore_eos=True, seed=s.seed + i, **kwargs)
                   for i in range(batch)]
            for name, kwargs in SAMPLED_RUNS.items()
        }
        engine_tok_s, hf_tok_s, greedy_steps = 0.0, None, []
        sampled_steps: dict[str, list[StepRecord]] = {}
        for _ in range(s.repeats):
            tok_s, steps = timed_generate(engine, prompts, params, batch)
            if tok_s > engine_tok_s:
                engine_tok_s, greedy_steps = tok_s, steps
            for name, run_params in sampled_params.items():
                _, steps = timed_generate(engine, prompts, run_params, batch)
                if name not in sampled_steps or median_ms(steps) < median_ms(sampled_steps[name]):
                    sampled_steps[name] = steps
            if hf is not None and batch in hf_batches:
                hf_tok_s = max(hf_tok_s or 0.0, hf.tok_s(prompts, s.new_tokens))
        step = median_ms(greedy_steps)
        sample_ms = {"greedy": median_ms(greedy_steps, "sample")}
        sample_ms.update({name: median_ms(steps, "sample") for name, steps in sampled_steps.items()})
        rows.append({
            "batch": batch, "engine_tok_s": engine_tok_s, "hf_tok_s": hf_tok_s,
            "ratio": engine_tok_s / hf_tok_s if hf_tok_s else None, "engine_decode_step_ms": step,
            "decode_tok_s": batch * 1e3 / step, "sampled_decode_step_ms": median_ms(sampled_steps["t1"]),
            "top_p_decode_step_ms": median_ms(sampled_steps["t1_top_p"]), "sample_ms": sample_ms,
        })
        hf_text = f"HF {hf_tok_s:.1f} tok/s" if hf_tok_s else "HF skipped"
        log(f"      B={batch}: engine {engine_tok_s:.1f} tok/s (decode step {step:.1f} ms greedy, "
            f"{rows[-1]['sampled_decode_step_ms']:.1f} ms at temperature 1), {hf_text}")
        if batch == biggest:
            step_ms = step
    return rows, step_ms, held_weight_bytes(engine)


# ---- the memory floor ---------------------------------------------------------------------------------------------


def memory_floor(s: BenchSettings, bandwidth_gbs: float, held_bytes: int | None = None) -> dict:
    """What one decode step must read (every weight once, each sequence's cached K and V once) at the measured
    bandwidth: no step can be faster. The context is the fixed batches' mean (prompt plus half the new tokens). The
    weights are counted from the model's shape in ``s.dtype``; quantized, as the engine holds them (``held_bytes``,
    :func:`bench.engines.held_weight_bytes`)."""
    shape = ModelShape.from_model_dir(s.model)
    dtype_bytes = EngineConfig(dtype=s.dtype).dtype_bytes
    d, qkv = shape.hidden_size, (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    per_layer = d * qkv + shape.num_heads * shape.head_dim * d + 3 * d * shape.intermediate_size + 2 * d
    weight_bytes = (shape.num_layers * per_layer + shape.vocab_size * d + d) * dtype_bytes  # LM head included
    if s.quantization and held_bytes is not None:
        weight_bytes = held_bytes
    kv_bytes_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes
    mean_context = s.prompt_len + (s.new_tokens + 1) / 2
    return {
        "bandwidth_gbs": bandwidth_gbs, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
        "mean_context": mean_context,
        "step_ms": {
            batch: (weight_bytes + batch * mean_context * kv_bytes_per_token) / (bandwidth_gbs * 1e9) * 1e3
            for batch in s.batches
        },
    }


class HFGenerate:
    """The baseline: HF transformers ``generate`` on a static batch, same dtype and threads as the engine."""

    def __init__(self, s: BenchSettings) -> None:
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, s.dtype)  # the engine's dtype names are torch's
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


def run_workload(s: BenchSettings, policy: str, requests: list[tuple[list[int], int]]) -> PolicyRun:
    longest = s.workload_prompt_range[1] + max(s.workload_long_range[1], s.workload_short_range[1])
    engine = s.engine(max_num_seqs=s.workload_max_num_seqs, max_model_len=longest + 16, batching=policy, seed=s.seed)
    for i, (prompt, output_len) in enumerate(requests):
        engine.add_request(f"w{i}", prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    block_size = engine.config.block_size
    num_seqs: list[int] = []
    tokens_in_cache = slots_held = 0
    busy = prefill_busy = 0.0
    prefill_steps = prefill_step_decodes = 0
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
            prefill_steps += 1
            prefill_step_decodes += record.num_decodes
        # Sampled after each step, over the requests that hold blocks (outside the timed region).
        running = engine.scheduler.running
        tokens_in_cache += sum(r.num_computed_tokens for r in running)
        slots_held += sum(len(r.block_ids) for r in running) * block_size
    generated = engine.stats.num_generation_tokens
    del engine
    return PolicyRun(
        tok_s=generated / busy,
        mean_batch=statistics.fmean(num_seqs),
        num_steps=len(num_seqs),
        fragmentation=1 - tokens_in_cache / slots_held if slots_held else 0.0,
        num_output_tokens=generated,
        prefill_s=prefill_busy,
        decode_s=busy - prefill_busy,
        prefill_steps=prefill_steps,
        prefill_step_decodes=prefill_step_decodes,
    )


# ---- 3. scheduler cost --------------------------------------------------------------------------------------------


def scheduler_us_per_step(num_seqs: int, steps: int = 200, block_size: int = 16) -> float:
    """schedule() + update() with ``num_seqs`` running decodes; a fake model returns token 7 for everyone."""
    config = EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs), max_model_len=4096)
    pool = BlockManager(num_seqs * (4096 // block_size), block_size)
    scheduler = Scheduler(config, pool)
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
    engine = s.engine(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs), max_model_len=context + 16,
                      num_kv_blocks=num_seqs * blocks_for(context + 1) + 1)
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
        inputs = engine.runner.prepare([ScheduledRequest.of(r, 1) for r in requests])
        engine.sampler(engine.runner.run(inputs), ids, params)
        timings.append(time.perf_counter() - start)
    del engine
    return statistics.median(timings[1:]) * 1e3


# ---- the whole run ------------------------------------------------------------------------------------------------


def run_bench(s: BenchSettings, log=print) -> dict:
    """Run every part and return the JSON-ready figures (keys documented in the module docstring)."""
    torch.set_num_threads(s.threads)
    log(f"[1/5] fixed batches {list(s.batches)}: engine ({s.weight_format} weights) and HF generate, best of "
        f"{s.repeats} ...")
    engine_rows, biggest_step_ms, held_bytes = fixed_batches(s, log)
    floor = memory_floor(s, read_bandwidth_gbs(s.threads), held_bytes)
    for row in engine_rows:
        row["floor_ms"] = floor["step_ms"][row["batch"]]
        row["step_over_floor"] = row["engine_decode_step_ms"] / row["floor_ms"]
    log(f"      memory floor: {floor['weight_bytes'] / 1e6:.0f} MB of weights per step at "
        f"{floor['bandwidth_gbs']:.1f} GB/s = {floor['step_ms'][min(s.batches)]:.1f} ms")

    served = None
    if s.served_models:
        log(f"[2/5] served: {', '.join(s.served_models)} on a real tritonserver, gRPC streaming ...")
        served = served_column(s.model, s.dtype, s.served_models, s.batches, s.prompt_len, s.new_tokens, s.repeats,
                               s.seed, engine_rows, log, quantization=s.quantization)
    llamacpp = None
    if s.llamacpp:
        log(f"[2/5] llama.cpp: {s.llamacpp}, the same decode workloads over HTTP streaming ...")
        prompts = random_prompts(max(s.batches), s.prompt_len, ModelShape.from_model_dir(s.model).vocab_size, s.seed)
        llamacpp = llamacpp_column(s.llamacpp, s.model, s.threads, s.batches, prompts, s.new_tokens, s.repeats,
                                   s.seed, log, gguf=s.llamacpp_gguf, quantization=s.quantization)

    log(f"[3/5] workload: {s.workload_requests} requests, continuous vs static ...")
    vocab = ModelShape.from_model_dir(s.model).vocab_size
    requests = workload_requests(s, vocab)
    cont = run_workload(s, "continuous", requests)
    log(f"      continuous: {cont.tok_s:.1f} tok/s, mean batch {cont.mean_batch:.1f}")
    stat = run_workload(s, "run_to_completion", requests)
    log(f"      static: {stat.tok_s:.1f} tok/s, mean batch {stat.mean_batch:.1f}")
    workload = WorkloadComparison(
        num_requests=len(requests),
        max_num_seqs=s.workload_max_num_seqs,
        num_prompt_tokens=sum(len(p) for p, _ in requests),
        continuous=cont,
        static=stat,
    )

    log(f"[3b/5] mixed steps against their parts: (decodes, chunk) {list(s.mixed_cases)} ...")
    mixed = mixed_step_breakdown(s.model, s.dtype, s.threads, list(s.mixed_cases), rounds=s.mixed_rounds,
                                 seed=s.seed, log=log, quantization=s.quantization)

    log(f"[4/5] scheduler cost at {s.scheduler_seqs} sequences ...")
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
        "model": s.model, "dtype": s.dtype, "quantization": s.weight_format, "threads": s.threads,
        "quick": s.quick, "repeats": s.repeats,
        "prompt_len": s.prompt_len,
        "new_tokens": s.new_tokens, "torch": torch.__version__, "cpu_count": os.cpu_count(),
    }
    result = {"config": config, "fixed_batches": engine_rows, "memory_floor": floor, "served": served,
              "workload": workload.to_json(), "mixed_steps": mixed, "scheduler": scheduler}
    if llamacpp is not None:
        result["llamacpp"] = llamacpp
    log("[5/5] targets")
    result["targets"] = judge_targets(result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a reduced run of about a minute (smoke test)")
    parser.add_argument("--batches", help="comma-separated fixed batch sizes (default 1,8,32,64; quick 1,8)")
    parser.add_argument("--hf-batches", help="comma-separated batch sizes at which to run HF generate (default all)")
    parser.add_argument("--repeats", type=int, help="fixed batches: best of N runs, engine and HF alike (default 2)")
    parser.add_argument("--served-models", help="comma-separated models for the served column "
                        f"(default {','.join(SERVED_MODELS)}; empty: no served column)")
    parser.add_argument("--llamacpp", metavar="PATH", help="llama.cpp's llama-server binary: run its column and "
                        "judge the target against it (`make llamacpp` builds .llamacpp/bin/llama-server)")
    parser.add_argument("--llamacpp-gguf", metavar="PATH", help="the GGUF llama.cpp serves (default: the one of "
                        "--quantization's format that `make llamacpp` puts beside the server: <model>-q4_1.gguf for "
                        "q4_1, else <model>-bf16.gguf)")
    parser.add_argument("--quantization", choices=[str(f) for f in WEIGHT_FORMATS], default=str(WeightFormat.BF16),
                        help="the weights of the engines and the served column (default: %(default)s)")
    parser.add_argument("--out", default="reports/bench.json")
    args = parser.parse_args(argv)
    if args.llamacpp_gguf and not args.llamacpp:
        parser.error("--llamacpp-gguf is the GGUF of the llama.cpp column: give the server with --llamacpp PATH")
    weights = WeightFormat(args.quantization)
    overrides = {
        "dtype": args.dtype, "threads": args.threads, "llamacpp": args.llamacpp, "llamacpp_gguf": args.llamacpp_gguf,
        "quantization": weights if weights.quantized else None,
    }
    if args.batches:
        overrides["batches"] = tuple(int(b) for b in args.batches.split(","))
    if args.repeats:
        overrides["repeats"] = args.repeats
    if args.served_models is not None:
        overrides["served_models"] = tuple(m for m in args.served_models.split(",") if m)
    if args.hf_batches is not None:
        overrides["hf_batches"] = tuple(int(b) for b in args.hf_batches.split(",") if b)
    settings = (BenchSettings.quick_settings if args.quick else BenchSettings)(model=args.model, **overrides)
    record = Record.start("make bench", {**vars(args), "settings": dataclasses.asdict(settings)})
    result = run_bench(settings, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(format_table(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    kept = add_tables(record, result).write(out.with_suffix(".record.json"))
    print(f"\nwritten to {out}; the run's record to {kept}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
