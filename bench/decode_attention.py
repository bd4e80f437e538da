"""What reading the pool's bf16 rows in place is worth to the decode attention (``decode_attention_items`` in
``backend/kernels/cpu/attention.c``): engine decode steps with each tile of K and V rows widened to float32 first
(the baseline, as before) beside the same steps with the rows read in place (as shipped): on a CPU with AVX512-BF16,
the scores taken by ``vdpbf16ps`` straight from the bf16 rows and each V row widened once for all the query heads of
its KV head; on one with AVX2 and no AVX-512, each K and V row widened in registers once for three query heads
(``score_avx2``, ``weigh_values_avx2``).

    .venv/bin/python -m bench.decode_attention [--shapes 16x128 64x128 64x960] [--rounds 12]
        [--out reports/bench_decode_attention.json]

A shape ``BxP`` is B sequences with prompts of P tokens, timed while they decode (the context grows by one token a
step, from P + 1). One engine in one process; the path is switched in the library before every step, the arms
alternating, so whatever else the machine does falls on both alike. Beside each step, the attention alone: the
kernel over the same shape (one call per layer, on a pool laid out as the engine's), the arms alternating again.
Each figure is the median. The run's record (``records/``) goes beside the JSON
(``bench_decode_attention.record.json``), table ``decode``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import torch  # noqa: E402

from backend.engine.sampling_params import SamplingParams  # noqa: E402
from backend.kernels import cpu_kernels  # noqa: E402
from bench.engines import blocks_for, build_engine  # noqa: E402
from bench.prefill_attention import parse_shape  # noqa: E402
from records.record import Column, Record  # noqa: E402

ARMS = {"widened": True, "direct": False}  # arm -> set_decode_attention_widened(...)


def step_ms(model: str, shapes: list[tuple[int, int]], rounds: int = 12, seed: int = 0) -> list[dict]:
    """A row per ``(batch, prompt)``: each arm's median milliseconds per decode step (``<arm>``) and per layer-count
    of attention calls alone (``<arm>_attention``)."""
    if cpu_kernels.load() is None:
        raise SystemExit("the CPU kernels are not built here: nothing to compare")
    # NOTE: room past the prompt for the steps that prefill the others while the first ones decode, then the rounds
    longest = max(p for _, p in shapes) + 2 * rounds + 256
    engine = build_engine(model, None, dtype="bfloat16", max_num_seqs=max(b for b, _ in shapes),
                          max_num_batched_tokens=2048, max_model_len=longest,
                          num_kv_blocks=max(b * blocks_for(longest) for b, _ in shapes) + 16, seed=seed)
    rng = random.Random(seed)
    vocab = engine.runner.shape.vocab_size
    before = cpu_kernels.set_decode_attention_widened(False)
    rows = []
    try:
        for batch, prompt_len in shapes:
            steps = _decode_steps(engine, batch, prompt_len, rounds, rng, vocab)
            kernel = _attention_alone(engine, batch, prompt_len, rounds, seed)
            rows.append({"batch": batch, "prompt": prompt_len, **steps, **kernel})
    finally:
        cpu_kernels.set_decode_attention_widened(before)  # the process's own path again, whatever happened
    return rows


def _decode_steps(engine, batch: int, prompt_len: int, rounds: int, rng: random.Random, vocab: int) -> dict:
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
    ids = [engine.add_request(None, [rng.randrange(100, vocab - 100) for _ in range(prompt_len)], params).request_id
           for _ in range(batch)]
    while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # the prompts, then every sequence decodes
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    names = list(ARMS)
    for i in range(2 * rounds + 2):  # the first two steps warm up
        arm = names[i % 2]
        cpu_kernels.set_decode_attention_widened(ARMS[arm])
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        ran = engine.stats.recent_steps()[-1].num_seqs
        if ran != batch:
            raise RuntimeError(f"a decode step ran {ran} sequences, not {batch}")
        if i >= 2:
            times[arm].append(elapsed)
    for request_id in ids:
        engine.abort(request_id)
    return {arm: statistics.median(t) * 1e3 for arm, t in times.items()}


def _attention_alone(engine, batch: int, prompt_len: int, rounds: int, seed: int) -> dict:
    """The kernel alone at this shape, once per layer: each sequence's context ``prompt_len`` plus the decode steps'
    tokens, its blocks scattered through a pool shaped as the engine's, one pool per layer (as the engine's: one
    pool read 30 times would come from the caches at short contexts)."""
    shape = engine.runner.shape
    heads, kv_heads, head_dim, layers = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.num_layers
    block_size = engine.config.block_size
    generator = torch.Generator().manual_seed(seed)
    context = prompt_len + rounds
    per_seq = blocks_for(context, block_size)
    total = batch * per_seq + 1
    pools = [tuple(torch.randn(total, block_size, kv_heads, head_dim, generator=generator).to(torch.bfloat16)
                   for _ in range(2)) for _ in range(layers)]
    tables = torch.randperm(total, generator=generator)[: batch * per_seq].to(torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, heads, head_dim, generator=generator).to(torch.bfloat16)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    names = list(ARMS)
    for i in range(2 * rounds + 2):
        arm = names[i % 2]
        cpu_kernels.set_decode_attention_widened(ARMS[arm])
        start = time.perf_counter()
        for k_cache, v_cache in pools:
            cpu_kernels.cpu_decode_attention(query, k_cache, v_cache, tables, lens, head_dim ** -0.5)
        if i >= 2:
            times[arm].append(time.perf_counter() - start)
    return {f"{arm}_attention": statistics.median(t) * 1e3 for arm, t in times.items()}


def record_table(record: Record, rows: list[dict]) -> Record:
    """The table ``decode``: a row per shape, the direct path beside the widened one, for the step and the attention."""
    columns = [Column("batch"), Column("prompt", "prompt tokens"),
               Column("widened", "step widened ms", "{:.1f}"), Column("direct", "step direct ms", "{:.1f}"),
               Column("step_ratio", "step direct x widened", "{:.3f}x"),
               Column("widened_attention", "attention widened ms", "{:.2f}"),
               Column("direct_attention", "attention direct ms", "{:.2f}"),
               Column("attention_ratio", "attention direct x widened", "{:.3f}x")]
    table = [{**row, "step_ratio": row["direct"] / row["widened"],
              "attention_ratio": row["direct_attention"] / row["widened_attention"]} for row in rows]
    record.add_table("decode", columns, table)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[(16, 128), (64, 128), (64, 960)],
                        help="BxP: B sequences decoding after prompts of P tokens")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("reports/bench_decode_attention.json"))
    args = parser.parse_args(argv)
    record = Record.start("python -m bench.decode_attention", vars(args))
    rows = step_ms(args.model, args.shapes, args.rounds)
    print(f"decode steps and their attention alone, {args.model}, bf16, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} rounds")
    print(record_table(record, rows).tables["decode"].markdown())
    record.write_beside(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
