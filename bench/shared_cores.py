"""Engines that share the cores: N engines (1, 2, 4), each in its own process, stepping decode batches at once,
per-engine step time against the same engine alone, for each way of sharing, in one run.

    python -m bench.shared_cores --model models/smollm2-135m-instruct [--engines 1,2,4]
        [--batch 4] [--seconds 5] [--rounds 3] [--arms divide,step_lock,off,passive] [--out reports/shared_cores.json]

The run's record (``records/``) goes beside the JSON (``reports/shared_cores.record.json``), table ``shared_cores``.

Each process is what a Triton model instance is: its own engine and OpenMP team, its threads spinning between a
step's parallel regions (``backend/engine/openmp.py``), all of them registered in one file
(``backend/engine/shared_cores.py``). The arms:

* ``divide``, ``step_lock``, ``off``: the engine's ``core_sharing`` settings (``off``: every engine on every thread,
  as before the registry);
* ``passive``: ``off`` in processes started with ``OMP_WAIT_POLICY=PASSIVE`` (threads sleep between regions):
  what switching the wait policy while another engine is busy would give while it is busy.

Every round runs every arm at every N, arms alternating (another first each round), so background load hits them
alike; figures are medians
over the rounds. Per arm and N: ``step_ms`` (median decode step over the engines), ``ratio`` (against the same arm
alone) and ``ratio_vs_spin_alone`` (against ``off`` alone: today's engine alone), ``tok_s`` (all engines' tokens
per second together) and ``tok_s_vs_alone`` (against ``off`` alone).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

from backend.contract.settings import DEFAULT_MODEL
from backend.engine.shared_cores import remove_registry
from records.record import Column, Record

ARMS = ("divide", "step_lock", "off", "passive")


def _worker(conn, model: str, batch: int, registry: str, passive: bool) -> None:
    """One engine in a process of its own: on ("run", sharing, start_at, seconds) step ``batch`` decoding
    sequences from ``start_at`` (``time.monotonic``, the same clock in every process) for ``seconds``."""
    if passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    from backend.engine.openmp import set_wait_policy

    set_wait_policy()  # NOTE: before torch is imported, as in every process that builds an engine
    from backend.engine.sampling_params import SamplingParams
    from backend.engine.shared_cores import CoreRegistry, SharedCores
    from bench.engines import build_engine

    engine = build_engine(model, max_num_seqs=batch, num_kv_blocks=64 * batch, max_model_len=1024, core_sharing="off")
    shared = CoreRegistry(registry)
    prompt = list(range(1000, 1032))
    params = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    conn.send("ready")
    while (message := conn.recv()) != "stop":
        _, sharing, start_at, seconds = message
        engine.cores.close()
        engine.cores = SharedCores(engine.runner.num_threads, sharing, shared)
        for i in range(batch):
            engine.add_request(f"r{i}", prompt, params)
        while any(r.num_output_tokens < 2 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
            engine.step()  # prefill and the first decode before the clock starts
        while time.monotonic() < start_at:
            time.sleep(0.001)
        steps = []
        while time.monotonic() < start_at + seconds:
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        for i in range(batch):
            engine.abort(f"r{i}")
        conn.send(steps)
    engine.cores.close()


def run(model: str, engines: list[int], batch: int, seconds: float, rounds: int, arms: list[str], log=print) -> dict:
    ctx = mp.get_context("spawn")
    most = max(engines)
    registry = tempfile.NamedTemporaryFile(prefix="llm-shared-cores-bench-", delete=False).name
    groups = {passive: [] for passive in sorted({arm == "passive" for arm in arms})}
    try:
        for passive, workers in groups.items():
            for _ in range(most):
                parent, child = ctx.Pipe()
                process = ctx.Process(target=_worker, args=(child, model, batch, registry, passive), daemon=True)
                process.start()
                if parent.recv() != "ready":
                    raise RuntimeError("an engine process did not start")
                workers.append((process, parent))
        log(f"{sum(map(len, groups.values()))} engine processes ready ({batch} sequences each)")
        samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for r in range(rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]  # NOTE: each round another arm goes first
            for n in engines:
                for arm in order:
                    workers = groups[arm == "passive"][:n]
                    start_at = time.monotonic() + 1.5
                    for _, conn in workers:
                        conn.send(("run", "off" if arm == "passive" else arm, start_at, seconds))
                    steps = [conn.recv() for _, conn in workers]
                    step_ms = statistics.median(statistics.median(s) for s in steps) * 1e3
                    tok_s = sum(len(s) for s in steps) * batch / seconds
                    samples.setdefault((arm, n), []).append((step_ms, tok_s))
                    log(f"round {r + 1}/{rounds}  {n} engine(s)  {arm:9s}  step {step_ms:6.1f} ms  {tok_s:6.1f} tok/s")
        for workers in groups.values():
            for process, conn in workers:
                conn.send("stop")
                process.join(10)
    finally:
        for workers in groups.values():
            for process, _ in workers:
                if process.is_alive():
                    process.kill()
        remove_registry(registry)
    return summarize(samples, engines, arms, batch, seconds, rounds)


def summarize(samples: dict, engines: list[int], arms: list[str], batch: int, seconds: float, rounds: int) -> dict:
    med = {key: (statistics.median(s for s, _ in v), statistics.median(t for _, t in v)) for key, v in samples.items()}
    spin_alone = med.get(("off", 1))
    rows = []
    for arm in arms:
        for n in engines:
            step_ms, tok_s = med[(arm, n)]
            alone_ms, _ = med.get((arm, 1), (None, None))
            rows.append({
                "arm": arm, "engines": n, "step_ms": round(step_ms, 2), "tok_s": round(tok_s, 1),
                "ratio": round(step_ms / alone_ms, 2) if alone_ms else None,
                "ratio_vs_spin_alone": round(step_ms / spin_alone[0], 2) if spin_alone else None,
                "tok_s_vs_alone": round(tok_s / spin_alone[1], 2) if spin_alone else None,
            })
    return {"config": {"batch": batch, "seconds": seconds, "rounds": rounds, "cores": os.cpu_count()}, "rows": rows}


COLUMNS = [
    Column("arm"), Column("engines"), Column("step_ms", "step ms (median)", "{:.1f}"),
    Column("ratio", "vs the same arm alone", "{:.2f}x"), Column("ratio_vs_spin_alone", "vs `off` alone", "{:.2f}x"),
    Column("tok_s", "tok/s, all engines", "{:.0f}"), Column("tok_s_vs_alone", "tok/s vs `off` alone", "{:.2f}x"),
]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("MODEL", DEFAULT_MODEL))
    p.add_argument("--engines", default="1,2,4", help="how many engines step at once, each a row")
    p.add_argument("--batch", type=int, default=4, help="decoding sequences per engine")
    p.add_argument("--seconds", type=float, default=5.0, help="measured time per arm, N and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", default="reports/shared_cores.json")
    args = p.parse_args(argv)
    engines = [int(n) for n in args.engines.split(",")]
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms or min(engines) < 1 or 1 not in engines:
        p.error(f"--arms from {', '.join(ARMS)}; --engines positive and including 1 (the baseline); got "
                f"{args.arms!r}, {args.engines!r}")
    record = Record.start("make bench-shared", vars(args))
    result = run(args.model, engines, args.batch, args.seconds, args.rounds, arms)
    record.add_table("shared_cores", COLUMNS, result["rows"])
    write_result(result, record, "shared_cores", args.out)


def write_result(result: dict, record: Record, table: str, out: str) -> None:
    """Print the record's table, write the figures as JSON and the record beside them."""
    print(record.tables[table].markdown())
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path} and {record.write(path.with_suffix('.record.json'))}")


if __name__ == "__main__":
    main()
