"""What the C prefill attention kernel (``prefill_attention`` in ``backend/kernels/cpu/attention.c``) saves: a whole
prefill step (:meth:`LLMEngine.step`: schedule, the 30 layers' forward, the sample) of k fresh prompts of n tokens,
with the chunks attended by the kernel beside the same step with them attended by torch's SDPA (the baseline, as
before the kernel). One engine, its attention backend swapped between arms; the arms alternate every round so that
background load hits them alike, and each figure is the median over the rounds.

    .venv/bin/python -m bench.prefill_attention --prompts 1x128 4x128 8x128 1x512 [--out reports/bench_prefill.json]

The run's record (``records/``) goes beside the JSON (``bench_prefill.record.json``), table ``prefill``.
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

from backend.engine.attention import CpuAttention  # noqa: E402
from backend.engine.sampling_params import SamplingParams  # noqa: E402
from backend.kernels import cpu_kernels  # noqa: E402
from bench.engines import build_engine  # noqa: E402
from records.record import Column, Record  # noqa: E402

ARMS = {"sdpa": False, "kernel": True}  # arm -> CpuAttention(prefill_kernel=...)


def parse_shape(text: str) -> tuple[int, int]:
    """``"4x128"``: 4 prompts of 128 tokens."""
    prompts, _, tokens = text.partition("x")
    try:
        shape = int(prompts), int(tokens)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PROMPTSxTOKENS such as 4x128, got {text!r}") from None
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"prompts and tokens must be at least 1, got {text!r}")
    return shape


def prefill_step_ms(model: str, shapes: list[tuple[int, int]], rounds: int = 8, threads: int | None = None,
                    seed: int = 0) -> list[dict]:
    """One entry per ``(prompts, tokens)``: ``prompts``, ``tokens``, and each arm's median milliseconds per step."""
    if not cpu_kernels.prefill_attention_available():
        raise SystemExit("the prefill kernel is not in this build (it needs AVX512-BF16, or AVX2 and FMA)")
    widest = max(k * n for k, n in shapes)
    engine = build_engine(model, None, dtype="bfloat16", num_threads=threads, max_num_seqs=max(k for k, _ in shapes),
                          max_num_batched_tokens=widest, max_model_len=max(n for _, n in shapes) + 16, seed=seed)
    vocab = engine.runner.shape.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    backends = {arm: CpuAttention(prefill_kernel=kernel) for arm, kernel in ARMS.items()}

    def step(arm: str, prompts: int, tokens: int) -> float:
        engine.runner.model.attention = backends[arm]
        for _ in range(prompts):
            engine.add_request(None, [rng.randrange(100, vocab - 100) for _ in range(tokens)], params)
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        record = engine.stats.recent_steps()[-1]
        if (record.num_seqs, record.num_tokens) != (prompts, prompts * tokens) or engine.has_unfinished():
            raise RuntimeError(f"the step ran {record.num_seqs} sequences and {record.num_tokens} tokens, not "
                               f"{prompts} prompts of {tokens}: it no longer measures what it says")
        return elapsed

    rows = []
    for prompts, tokens in shapes:
        times: dict[str, list[float]] = {arm: [] for arm in ARMS}
        names = list(ARMS)
        for i in range(rounds + 1):  # the first round warms up
            for arm in names[i % len(names):] + names[:i % len(names)]:
                elapsed = step(arm, prompts, tokens)
                if i:
                    times[arm].append(elapsed)
        rows.append({"prompts": prompts, "tokens": tokens,
                     **{arm: statistics.median(t) * 1e3 for arm, t in times.items()}})
    return rows


def record_table(record: Record, rows: list[dict]) -> Record:
    """The table ``prefill``: a row per shape, the kernel's step beside SDPA's from the same run."""
    columns = [Column("prompts"), Column("tokens", "tokens each"), Column("sdpa", "step with SDPA ms", "{:.1f}"),
               Column("kernel", "step with the kernel ms", "{:.1f}"), Column("ratio", "kernel x SDPA", "{:.3f}x")]
    record.add_table("prefill", columns, [{**row, "ratio": row["kernel"] / row["sdpa"]} for row in rows])
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--prompts", type=parse_shape, nargs="+", default=[(1, 128), (4, 128), (8, 128), (1, 512)],
                        help="PROMPTSxTOKENS shapes of the prefill step (default: 1x128 4x128 8x128 1x512)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_prefill.json"))
    args = parser.parse_args(argv)
    record = Record.start("python -m bench.prefill_attention", vars(args))
    rows = prefill_step_ms(args.model, args.prompts, args.rounds, args.threads)
    print(f"prefill step, {args.model}, bf16, {torch.get_num_threads()} threads, median of {args.rounds} rounds")
    print(record_table(record, rows).tables["prefill"].markdown())
    record.write_beside(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
