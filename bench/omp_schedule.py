"""What the projections' dynamic schedule is worth: engine steps with the loops of ``linear_small`` and the decode
attention shared out statically (each thread a fixed half of the panels: the baseline, as before) beside
the same steps with each thread taking the next panel when it finishes one (``dynamic,1``, as shipped:
``backend/engine/openmp.py``), on a quiet machine and beside a neighbour process that takes a share of one core in
short bursts, as the server's frontend and tritonserver do while tokens stream.

    .venv/bin/python -m bench.omp_schedule [--rounds 12] [--busy-ms 2 --idle-ms 8]
        [--out reports/bench_omp_schedule.json]

One engine in one process; the loops read OpenMP's run schedule (``schedule(runtime)``), which is set before every
step, the arms alternating, so that whatever else the machine does falls on both alike. Each figure is the median
step. The run's record (``records/``) goes beside the JSON (``bench_omp_schedule.record.json``), table ``schedule``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import time
from pathlib import Path

from backend.engine.openmp import run_schedule, set_run_schedule, set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import torch  # noqa: E402

from backend.engine.sampling_params import SamplingParams  # noqa: E402
from bench.engines import build_engine  # noqa: E402
from records.record import Column, Record  # noqa: E402

# arm -> OpenMP run schedule (kind, chunk): chunk 0 is static's equal blocks
ARMS = {"static": ("static", 0), "dynamic": ("dynamic", 1)}


def neighbour(stop, busy_ms: float, idle_ms: float) -> None:
    """Burn one core for ``busy_ms``, sleep ``idle_ms``, until ``stop`` is set."""
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < busy_ms / 1e3:
            pass
        time.sleep(idle_ms / 1e3)


def step_ms(model: str, rounds: int = 12, decode_batches: tuple[int, ...] = (64, 16), prompts: int = 4,
            prompt_len: int = 128, seed: int = 0) -> dict[str, dict[str, float]]:
    """Median milliseconds per step of each arm: a prefill step of ``prompts`` fresh prompts of ``prompt_len``
    tokens (``prefill``), and a decode step of each of ``decode_batches`` sequences (``decode <b>``)."""
    torch.get_num_threads()  # OpenMP's runtime loaded, to set the schedule in
    before = run_schedule()
    engine = build_engine(model, None, dtype="bfloat16", max_num_seqs=max(decode_batches, default=prompts),
                          max_num_batched_tokens=max(512, prompts * prompt_len), max_model_len=2048, seed=seed)
    rng = random.Random(seed)
    vocab = engine.runner.shape.vocab_size
    prompt = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    times: dict[str, dict[str, list[float]]] = {}
    try:
        _run_steps(engine, times, rounds, decode_batches, prompts, prompt_len, prompt)
    finally:
        set_run_schedule(*before)  # the process's own schedule again, whatever happened
    return {workload: {arm: statistics.median(t) * 1e3 for arm, t in arms.items()} for workload, arms in times.items()}


def _run_steps(engine, times: dict, rounds: int, decode_batches: tuple[int, ...], prompts: int, prompt_len: int,
               prompt) -> None:
    """The timed steps of :func:`step_ms`, each arm's seconds appended to ``times[workload][arm]``."""

    def timed(workload: str, arm: str) -> None:
        set_run_schedule(*ARMS[arm])
        start = time.perf_counter()
        engine.step()
        times.setdefault(workload, {a: [] for a in ARMS})[arm].append(time.perf_counter() - start)

    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    names = list(ARMS)
    for i in range(rounds + 1):  # the first round warms up
        for arm in names if i % 2 else names[::-1]:
            for _ in range(prompts):
                engine.add_request(None, prompt(prompt_len), one)
            timed("prefill", arm)
            record = engine.stats.recent_steps()[-1]
            if (record.num_seqs, record.num_tokens) != (prompts, prompts * prompt_len):
                raise RuntimeError(f"the prefill step ran {record.num_seqs} sequences and {record.num_tokens} tokens")
        if i == 0:
            times.clear()
    for batch in decode_batches:
        params = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0.0)
        ids = [engine.add_request(None, prompt(64), params).request_id for _ in range(batch)]
        while engine.scheduler.num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
            engine.step()  # the prompts, then every sequence decodes
        for i in range(2 * rounds):
            timed(f"decode {batch}", names[i % 2])
            ran = engine.stats.recent_steps()[-1].num_seqs
            if ran != batch:
                raise RuntimeError(f"a decode step ran {ran} sequences, not {batch}")
        for request_id in ids:
            engine.abort(request_id)


def measure(model: str, rounds: int, busy_ms: float, idle_ms: float) -> list[dict]:
    """A row per (machine, workload): quiet, then beside the neighbour process."""
    rows = []
    for machine in ("quiet", "neighbour"):
        stop = multiprocessing.Event()
        burner = None
        if machine == "neighbour":
            burner = multiprocessing.Process(target=neighbour, args=(stop, busy_ms, idle_ms), daemon=True)
            burner.start()
        try:
            figures = step_ms(model, rounds)
        finally:
            stop.set()
            if burner is not None:
                burner.join(10)
        rows += [{"machine": machine, "workload": workload, **arms} for workload, arms in figures.items()]
    return rows


def record_table(record: Record, rows: list[dict]) -> Record:
    """The table ``schedule``: a row per machine and workload, the dynamic schedule beside the static one."""
    columns = [Column("machine"), Column("workload", "step"), Column("static", "static ms", "{:.1f}"),
               Column("dynamic", "dynamic,1 ms", "{:.1f}"), Column("ratio", "dynamic x static", "{:.3f}x")]
    record.add_table("schedule", columns, [{**row, "ratio": row["dynamic"] / row["static"]} for row in rows])
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--busy-ms", type=float, default=2.0, help="the neighbour's burst on one core")
    parser.add_argument("--idle-ms", type=float, default=8.0, help="the neighbour's sleep between bursts")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_omp_schedule.json"))
    args = parser.parse_args(argv)
    record = Record.start("python -m bench.omp_schedule", vars(args))
    rows = measure(args.model, args.rounds, args.busy_ms, args.idle_ms)
    print(f"engine steps, {args.model}, bf16, {torch.get_num_threads()} threads, median of {args.rounds} rounds; "
          f"the neighbour busy {args.busy_ms:g} ms of every {args.busy_ms + args.idle_ms:g} ms on one core")
    print(record_table(record, rows).tables["schedule"].markdown())
    record.write_beside(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
