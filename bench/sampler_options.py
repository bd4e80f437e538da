"""What the sampler's options cost: one sampler step (``Sampler.sample``) on random logits of the model's vocabulary,
plain (the baseline) beside the same step with ``logprobs`` (the top k) and with penalties and a logit bias, at each
batch size. Every row of a batch asks alike; the arms alternate every round so that background load hits them alike,
and each figure is the median over the rounds.

    .venv/bin/python -m bench.sampler_options --batch 1 32 --logprobs 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from backend.engine.config import SamplingParams
from backend.engine.sampler import Sampler

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


def table(rows: list[dict]) -> str:
    names = [n for n in rows[0] if n != "batch"]
    baseline = names[0]
    head = "| batch | " + " | ".join(f"{n} ms" if n == baseline else f"{n} ms (x {baseline})" for n in names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 1)]
    for row in rows:
        cells = [f"{row[baseline]:.3f}"] + [f"{row[n]:.3f} ({row[n] / row[baseline]:.2f}x)" for n in names[1:]]
        lines.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"sampler step, vocabulary {VOCAB}, bf16 logits, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} rounds")
    print(table(sampler_step_ms(args.batch, args.logprobs, args.rounds)))


if __name__ == "__main__":
    main()
