"""What the sampler's options cost: one sampler step (``Sampler.sample``) on random logits of the model's vocabulary,
plain (the baseline) beside the same step with ``logprobs`` (the top k) and with penalties and a logit bias, at each
batch size. Every row of a batch asks alike; the arms alternate every round so that background load hits them alike,
and each figure is the median over the rounds.

    .venv/bin/python -m bench.sampler_options --batch 1 32 --logprobs 5 [--out reports/bench_sampler_options.json]

The run's record (``records/``) goes beside the JSON (``bench_sampler_options.record.json``), table ``sampler``.
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

from backend.engine.sampler import Sampler  # noqa: E402
from backend.engine.sampling_params import SamplingParams  # noqa: E402
from records.record import Column, Record  # noqa: E402

VOCAB = 49152  # SmolLM2's


def arms(k: int) -> dict[str, SamplingParams]:
    sampled = dict(temperature=0.8, top_p=0.95, max_tokens=None)
    return {
        "plain": SamplingParams(**sampled),
        f"logprobs={k}": SamplingParams(**sampled, logprobs=k),
        "penalties+bias": SamplingParams(**sampled, presence_penalty=0.5, frequency_penalty=0.5,
                                         repetition_penalty=1.1, logit_bias={7: -5.0, 11: 3.0}),
    }


def sampler_step_ms(batches: list[int], k: int, rounds: int = 50, context: int = 512, dtype=torch.bfloat16,
                    seed: int = 0) -> list[dict]:
    """One entry per batch size: ``batch``, then each arm's median milliseconds per step."""
    rng = random.Random(seed)
    settings = arms(k)
    rows = []
    for batch in batches:
        logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)).to(dtype)
        ids = [f"r{i}" for i in range(batch)]
        history = [[rng.randrange(VOCAB) for _ in range(context)] for _ in range(batch)]
        prompt_lens = [context // 2] * batch
        sampler = Sampler(seed)
        times: dict[str, list[float]] = {name: [] for name in settings}
        names = list(settings)
        for i in range(rounds + 1):  # the first round warms up
            for name in names[i % len(names):] + names[:i % len(names)]:
                params = [settings[name]] * batch
                t0 = time.perf_counter()
                sampler.sample(logits.clone(), ids, params, None, history, prompt_lens)
                if i:
                    times[name].append(time.perf_counter() - t0)
        rows.append({"batch": batch, **{name: statistics.median(t) * 1e3 for name, t in times.items()}})
    return rows


def record_table(record: Record, rows: list[dict]) -> Record:
    """The table ``sampler``: a row per batch, each arm's step beside the plain one from the same run."""
    names = [n for n in rows[0] if n != "batch"]
    baseline = names[0]
    columns = [Column("batch"), Column(baseline, f"{baseline} ms", "{:.3f}")]
    for name in names[1:]:
        columns += [Column(name, f"{name} ms", "{:.3f}"), Column(f"{name}_x", f"{name} x {baseline}", "{:.2f}x")]
    table_rows = [{**row, **{f"{n}_x": row[n] / row[baseline] for n in names[1:]}} for row in rows]
    record.add_table("sampler", columns, table_rows)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_sampler_options.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    record = Record.start("python -m bench.sampler_options", vars(args))
    print(f"sampler step, vocabulary {VOCAB}, bf16 logits, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} rounds")
    rows = sampler_step_ms(args.batch, args.logprobs, args.rounds)
    print(record_table(record, rows).tables["sampler"].markdown())
    record.write_beside(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
