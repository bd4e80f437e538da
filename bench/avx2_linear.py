"""What the projections' panels (``linear_rows_avx2`` in ``backend/kernels/cpu/linear_small.c``) are worth on a CPU
with AVX2 but no AVX512-BF16 (Zen 2 and 3, most client CPUs), where the bf16 weight is held row-major: beside the
route before them (``linear_small``'s one pass in registers to 8 rows, torch's bf16 ``F.linear`` above, which has no
fast path on such a CPU) and beside torch's float32 ``F.linear`` (what a float32 model runs: oneDNN's AVX2 GEMM).

    .venv/bin/python -m bench.avx2_linear [--rows 1 4 8 16 64 512] [--rounds 10] [--step-rounds 3]
        [--out reports/bench_avx2_linear.json]

Table ``projections``: each of the model's projection shapes (SmolLM2-135M's QKV, O, gate or up, down, LM head) at
each row count, the three arms alternating, the median milliseconds of each. Table ``steps``: whole engine steps of
one bfloat16 engine, a 512-token prefill (four prompts of 128) and decode steps of 16 and 64 sequences
(prompts of 128), the route
before and the panels alternating step by step. Both arms of a table run in one process, so whatever else the machine
does falls on both alike. The run's record (``records/``) goes beside the JSON (``bench_avx2_linear.record.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from backend.engine import linear  # noqa: E402
from backend.engine.config import ModelShape  # noqa: E402
from backend.engine.sampling_params import SamplingParams  # noqa: E402
from backend.kernels import cpu_kernels  # noqa: E402
from bench.engines import blocks_for, build_engine  # noqa: E402
from records.record import Column, Record  # noqa: E402

ARMS = ("before", "panels")


@contextlib.contextmanager
def route_before():
    """The route before the panels: ``linear_small``'s pass in registers up to ``SMALL_BATCH_ROWS``, torch's bf16
    ``F.linear`` above (the engine's routing as it was, by its one routing function's input)."""
    rows = cpu_kernels.set_linear_panel_rows(sys.maxsize >> 33)
    saved = linear._row_major_any_rows
    linear._row_major_any_rows = lambda: False
    try:
        yield
    finally:
        linear._row_major_any_rows = saved
        cpu_kernels.set_linear_panel_rows(rows)


def _arm(name: str):
    return route_before() if name == "before" else contextlib.nullcontext()


def shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """``name -> (N, K)`` of the model's projections."""
    hidden, heads, kv_heads, head_dim = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate/up": (shape.intermediate_size, hidden), "down": (hidden, shape.intermediate_size),
            "lm_head": (shape.vocab_size, hidden)}


def projection_ms(model_shapes: dict[str, tuple[int, int]], row_counts: list[int], rounds: int) -> list[dict]:
    """A row per (projection, rows): each arm's median milliseconds, and float32 torch's."""
    generator = torch.Generator().manual_seed(0)
    rows_out = []
    for name, (n, k) in model_shapes.items():
        weight = (torch.randn(n, k, generator=generator) * k ** -0.5).bfloat16()
        layer = linear.Linear(weight)
        weight32 = weight.float()
        for num_rows in row_counts:
            x = torch.randn(num_rows, k, generator=generator).bfloat16()
            times: dict[str, list[float]] = {arm: [] for arm in (*ARMS, "float32")}
            for i in range(rounds + 1):  # the first round warms up
                for arm in (list(times) if i % 2 == 0 else list(times)[::-1]):
                    elapsed = _projection_once(arm, layer, x, weight32)
                    if i:
                        times[arm].append(elapsed)
            rows_out.append({"projection": name, "n": n, "k": k, "rows": num_rows,
                             **{arm: statistics.median(t) * 1e3 for arm, t in times.items()}})
    return rows_out


def _projection_once(arm: str, layer: linear.Linear, x: torch.Tensor, weight32: torch.Tensor) -> float:
    if arm == "float32":
        x32 = x.float()
        start = time.perf_counter()
        F.linear(x32, weight32)
        return time.perf_counter() - start
    with _arm(arm):
        start = time.perf_counter()
        layer(x)
        return time.perf_counter() - start


def step_ms(model: str, rounds: int, prefill: tuple[int, int] = (4, 128), batches: tuple[int, ...] = (16, 64),
            seed: int = 0) -> list[dict]:
    """A row per step kind: each arm's median milliseconds per engine step (bfloat16): a prefill of ``prefill``
    (prompts, tokens each) in one step, then decode steps of each of ``batches`` sequences."""
    num_prompts, prompt_len = prefill
    most = max(num_prompts, *batches)
    engine = build_engine(model, None, dtype="bfloat16", max_num_seqs=most,
                          max_num_batched_tokens=max(512, num_prompts * prompt_len), max_model_len=prompt_len + 192,
                          num_kv_blocks=most * blocks_for(prompt_len + 192) + 16, seed=seed)
    vocab = engine.runner.shape.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)

    def add(num: int) -> list[str]:
        return [engine.add_request(None, [rng.randrange(100, vocab - 100) for _ in range(prompt_len)],
                                   params).request_id for _ in range(num)]

    def end(ids: list[str]) -> None:
        for request_id in ids:
            engine.abort(request_id)
        engine.step()  # nothing left to run: the aborted requests' blocks go back

    rows = []
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i in range(2 * rounds):  # the prompts in one step
        arm = ARMS[i % 2]
        ids = add(num_prompts)
        with _arm(arm):
            start = time.perf_counter()
            engine.step()
            times[arm].append(time.perf_counter() - start)
        if engine.stats.recent_steps()[-1].num_tokens != num_prompts * prompt_len:
            raise RuntimeError(f"the prefill step did not run the {num_prompts} prompts' tokens")
        end(ids)
    rows.append({"step": f"prefill {num_prompts} x {prompt_len}",
                 **{arm: statistics.median(t) * 1e3 for arm, t in times.items()}})
    for batch in batches:
        ids = add(batch)
        while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
            engine.step()  # the prompts, then every sequence decodes
        times = {arm: [] for arm in ARMS}
        for i in range(2 * rounds + 2):  # the first two steps warm up
            arm = ARMS[i % 2]
            with _arm(arm):
                start = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - start
            if engine.stats.recent_steps()[-1].num_seqs != batch:
                raise RuntimeError(f"a decode step did not run {batch} sequences")
            if i >= 2:
                times[arm].append(elapsed)
        end(ids)
        rows.append({"step": f"decode {batch}", **{arm: statistics.median(t) * 1e3 for arm, t in times.items()}})
    return rows


def record_tables(record: Record, projections: list[dict], steps: list[dict]) -> Record:
    """Tables ``projections`` and ``steps``: the panels beside the route before (and float32 torch's matmul)."""
    record.add_table("projections", [
        Column("projection"), Column("n", "N"), Column("k", "K"), Column("rows"),
        Column("before", "before ms", "{:.3f}"), Column("panels", "panels ms", "{:.3f}"),
        Column("float32", "float32 F.linear ms", "{:.3f}"), Column("ratio", "panels x before", "{:.3f}x"),
        Column("vs_float32", "panels x float32", "{:.3f}x"),
    ], [{**r, "ratio": r["panels"] / r["before"], "vs_float32": r["panels"] / r["float32"]} for r in projections])
    record.add_table("steps", [
        Column("step"), Column("before", "before ms", "{:.1f}"), Column("panels", "panels ms", "{:.1f}"),
        Column("ratio", "panels x before", "{:.3f}x"),
    ], [{**r, "ratio": r["panels"] / r["before"]} for r in steps])
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 512])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--step-rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("reports/bench_avx2_linear.json"))
    args = parser.parse_args(argv)
    if not cpu_kernels.row_major_any_rows():
        raise SystemExit("this build has no AVX2 panels (a CPU with AVX512-BF16, or without AVX2): nothing to compare")
    record = Record.start("python -m bench.avx2_linear", vars(args))
    projections = projection_ms(shapes(ModelShape.from_model_dir(args.model)), args.rows, args.rounds)
    steps = step_ms(args.model, args.step_rounds)
    record_tables(record, projections, steps)
    print(f"projections and engine steps, {args.model}, bf16 row-major, {torch.get_num_threads()} threads, medians")
    print(record.tables["projections"].markdown())
    print(record.tables["steps"].markdown())
    record.write_beside(args.out, {"projections": projections, "steps": steps})
    return 0


if __name__ == "__main__":
    sys.exit(main())
