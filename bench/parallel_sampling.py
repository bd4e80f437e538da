"""Parallel sampling: n answers of one prompt as one request with ``n`` (the prompt computed once, its KV blocks
shared by the n sequences) beside n separate requests of the same prompt (the baseline), in the same run.

Both arms run on one engine with prefix caching off (so the baseline does not share blocks either) and alternate over
the rounds, so background load on a shared machine hits them alike. Per arm: the KV blocks held at the step that
gives all n answers their first token (the peak of the prompt's blocks), the prompt tokens computed, and the time from
submitting to every answer's first token (the median over the rounds).

    python -m bench.parallel_sampling [--n 4] [--prompt-len 512] [--out reports/bench_parallel_sampling.record.json]

It prints the table and writes the run's record (``records/``) to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

from backend.contract.settings import DEFAULT_MODEL  # noqa: E402
from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.engine.sampling_params import SamplingParams  # noqa: E402
from bench.engines import blocks_for, build_engine, random_prompts, warm_up  # noqa: E402
from records.record import Column, Record  # noqa: E402

ARMS = ("separate requests", "one request, n")


def first_tokens(engine: LLMEngine, prompt: list[int], n: int, forked: bool, seed: int) -> dict:
    """Submit the arm's requests, step until each of the n answers has its first token, then abort them."""
    t0 = time.perf_counter()
    if forked:
        request_ids = [engine.add_request(None, prompt, SamplingParams(n=n, max_tokens=8, seed=seed)).request_id]
    else:
        request_ids = [engine.add_request(None, prompt, SamplingParams(max_tokens=8, seed=seed + i)).request_id
                       for i in range(n)]
    answered: set[tuple[str, int]] = set()
    num_tokens = num_blocks = 0
    while len(answered) < n:
        outputs = engine.step()
        num_tokens += engine.stats.recent_steps()[-1].num_tokens
        num_blocks = max(num_blocks, engine.block_manager.num_used_blocks)
        answered |= {(o.request_id, o.index) for o in outputs if o.new_token_ids}
    ttft = time.perf_counter() - t0
    for request_id in request_ids:
        engine.abort(request_id)
    return {"kv_blocks": num_blocks, "tokens_computed": num_tokens, "ttft_s": ttft}


def run(model: str, n: int = 4, prompt_len: int = 512, rounds: int = 3, threads: int = 2,
        dtype: str = "bfloat16") -> dict[str, dict]:
    """Each arm's figures: ``kv_blocks`` and ``tokens_computed`` (the most of any round), ``ttft_s`` (the median)."""
    engine = build_engine(
        model, None, dtype=dtype, num_threads=threads, max_num_seqs=n, max_num_batched_tokens=n * prompt_len,
        max_model_len=prompt_len + 64, num_kv_blocks=n * blocks_for(prompt_len + 64) + 16, enable_prefix_caching=False,
    )
    warm_up(engine, prompt_len)
    (prompt,) = random_prompts(1, prompt_len, engine.runner.shape.vocab_size, seed=1)
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for round_ in range(rounds):
        for arm in (ARMS if round_ % 2 == 0 else ARMS[::-1]):
            runs[arm].append(first_tokens(engine, prompt, n, arm == ARMS[1], seed=round_))
    return {arm: {"kv_blocks": max(r["kv_blocks"] for r in rs),
                  "tokens_computed": max(r["tokens_computed"] for r in rs),
                  "ttft_s": statistics.median(r["ttft_s"] for r in rs)} for arm, rs in runs.items()}


def record_table(record: Record, result: dict[str, dict], n: int, prompt_len: int) -> Record:
    """The table ``arms``: each arm's figures beside the baseline's (n separate requests) from the same run."""
    base = result[ARMS[0]]
    columns = [Column("arm", f"{n} answers of one {prompt_len}-token prompt"), Column("kv_blocks", "KV blocks held"),
               Column("tokens_computed", "prompt tokens computed"),
               Column("ttft_s", "time to all first tokens", "{:.2f} s"), Column("ratio", "x baseline", "{:.2f}x")]
    rows = [{"arm": f"{n} separate requests (baseline)" if arm == ARMS[0] else f"one request, n={n}",
             **r, "ratio": r["ttft_s"] / base["ttft_s"]} for arm, r in result.items()]
    record.add_table("arms", columns, rows)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    for option, default in (("--n", 4), ("--prompt-len", 512), ("--rounds", 3), ("--threads", 2)):
        parser.add_argument(option, type=int, default=default)
    parser.add_argument("--out", type=Path, default=Path("reports/bench_parallel_sampling.record.json"))
    args = parser.parse_args(argv)
    record = Record.start("python -m bench.parallel_sampling", vars(args))
    result = run(args.model, args.n, args.prompt_len, args.rounds, args.threads)
    print(record_table(record, result, args.n, args.prompt_len).tables["arms"].markdown())
    print(f"\nthe run's record: {record.write(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
