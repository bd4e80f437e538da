"""Models of one server under load at once, through real tritonservers: each model's inter-token gap and tokens/s
beside the same model alone, for each way of sharing the cores, in one run.

    python -m bench.shared_served [--arms divide,off,passive] [--users 4] [--phase-s 20] [--rounds 2]
        [--out reports/shared_served.json]    (its record beside it: shared_served.record.json)

One server per arm, all started before the first phase (the models load once, then sleep while another arm is
driven): ``divide`` and ``step_lock`` (the engine's ``core_sharing``), ``off`` (every engine on every thread: the
engine before the registry) and ``passive`` (``off`` with ``OMP_WAIT_POLICY=PASSIVE``: threads that sleep between
parallel regions). Each round runs, for every arm in turn (another arm first each round), the phases: each model
alone, ``llm_continuous`` and ``llm_dynamic`` together, and (with ``--four``) all four models together. A phase is
``--users`` closed-loop gRPC streams per model (each sends its next request when the last one ends:
``--max-tokens`` tokens, ``ignore_eos``), for ``--phase-s`` seconds after a short ramp. Per model and phase:
``itl_ms`` (median gap between two tokens of a request, its first two left out), ``tpot_ms`` (the median over
requests of each one's mean gap in the window: a burst of tokens delivered together makes many gaps near zero, which
the median gap counts and the mean gap does not) and ``tok_s`` (tokens that arrived in the window). Figures are
medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from backend.contract.names import CONTINUOUS, DYNAMIC, ITERATIVE, STATIC
from backend.contract.settings import DEFAULT_MODEL
from backend.triton.launcher.launch_options import copy_model_repository
from backend.triton.launcher.server import start_on_free_ports
from bench.shared_cores import write_result
from client.grpc_stream import generate
from records.record import Column, Record

REPO_ROOT = Path(__file__).resolve().parents[1]
# arm -> (the engines' core_sharing, environment of the server)
ARMS = {
    "divide": ("divide", {}),
    "step_lock": ("step_lock", {}),
    "off": ("off", {}),
    "passive": ("off", {"OMP_WAIT_POLICY": "PASSIVE"}),
}
PAIR = (CONTINUOUS, DYNAMIC)
FOUR = (STATIC, DYNAMIC, ITERATIVE, CONTINUOUS)
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
RAMP_S = 3.0


def drive(url: str, models: tuple[str, ...], users: int, seconds: float, max_tokens: int) -> dict:
    """``users`` closed-loop streams per model for ``RAMP_S + seconds``; per model the median token gap and the
    tokens/s of the last ``seconds``."""
    start = time.perf_counter()
    window = (start + RAMP_S, start + RAMP_S + seconds)
    gaps: dict[str, list[float]] = {m: [] for m in models}
    tpots: dict[str, list[float]] = {m: [] for m in models}  # per request: its mean gap in the window
    tokens: dict[str, int] = dict.fromkeys(models, 0)
    errors: list[str] = []
    lock = threading.Lock()

    def user(model: str) -> None:
        while time.perf_counter() < window[1]:
            stream = generate(url, model, PROMPT, timeout=300, max_tokens=max_tokens, ignore_eos=True, stream=True,
                              temperature=0.0)
            times = stream.arrival_times
            with lock:
                if stream.error:
                    errors.append(f"{model}: {stream.error}")
                    return
                inside = [t for t in times[2:] if window[0] <= t <= window[1]]
                gaps[model] += [b - a for a, b in zip(inside, inside[1:])]
                if len(inside) >= 8:
                    tpots[model].append((inside[-1] - inside[0]) / (len(inside) - 1))
                tokens[model] += sum(window[0] <= t < window[1] for t in times)

    threads = [threading.Thread(target=user, args=(m,), daemon=True) for m in models for _ in range(users)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError("; ".join(sorted(set(errors))[:5]))
    return {m: {"itl_ms": statistics.median(gaps[m]) * 1e3 if gaps[m] else None,
                "tpot_ms": statistics.median(tpots[m]) * 1e3 if tpots[m] else None, "tok_s": tokens[m] / seconds}
            for m in models}


def run(arms: list[str], users: int, phase_s: float, rounds: int, max_tokens: int, four: bool, log=print) -> dict:
    models = FOUR if four else PAIR
    phases = [("alone", (model,)) for model in models] + [("pair", PAIR)] + ([("four", FOUR)] if four else [])
    servers = {}
    with tempfile.TemporaryDirectory(prefix="shared-served-") as tmp:
        try:
            for arm in arms:
                sharing, env = ARMS[arm]
                # NOTE: a smaller KV pool than shipped (4 users need little), so four servers fit in memory.
                repository = copy_model_repository(Path(tmp) / arm, models, {
                    "core_sharing": sharing, "kv_cache_memory_bytes": str(128 << 20)})
                server = start_on_free_ports(repository, model=REPO_ROOT / DEFAULT_MODEL, env=env,
                                             log_path=Path(tmp) / f"{arm}.log")
                servers[arm] = server.__enter__()
                log(f"{arm}: server ready ({server.grpc_url})")
            for server in servers.values():  # warm-up: every model's first steps, once
                drive(server.grpc_url, models, 1, 1.0, 8)
            samples: dict[tuple, list[dict]] = {}
            for r in range(rounds):
                # NOTE: the first arm after a phase change measured slower alone: each round another goes first.
                order = arms[r % len(arms):] + arms[:r % len(arms)]
                for kind, phase_models in phases:
                    for arm in order:
                        server = servers[arm]
                        result = drive(server.grpc_url, phase_models, users, phase_s, max_tokens)
                        for model, figures in result.items():
                            key = (arm, "alone" if kind == "alone" else kind, model)
                            samples.setdefault(key, []).append(figures)
                        log(f"round {r + 1}/{rounds} {arm:9s} {kind:5s} " + "  ".join(
                            f"{m} {f['itl_ms'] or 0:6.1f} ms {f['tok_s']:5.0f} tok/s" for m, f in result.items()))
        finally:
            for server in servers.values():
                server.stop()
    return summarize(samples, arms, four)


def summarize(samples: dict, arms: list[str], four: bool) -> dict:
    def med(arm, kind, model, key):
        values = [s[key] for s in samples.get((arm, kind, model), []) if s[key] is not None]
        return statistics.median(values) if values else None

    rows = []
    for arm in arms:
        for kind in ("pair", "four") if four else ("pair",):
            models = PAIR if kind == "pair" else FOUR
            together = sum(med(arm, kind, m, "tok_s") or 0 for m in models)
            for model in models:
                alone_itl = med(arm, "alone", model, "itl_ms")
                base_itl = med("off", "alone", model, "itl_ms") if "off" in arms else None
                itl = med(arm, kind, model, "itl_ms")
                tpot, alone_tpot = med(arm, kind, model, "tpot_ms"), med(arm, "alone", model, "tpot_ms")
                rows.append({
                    "arm": arm, "phase": kind, "model": model, "itl_ms": itl,
                    "alone_itl_ms": alone_itl, "ratio": itl / alone_itl if itl and alone_itl else None,
                    "tpot_ms": tpot, "alone_tpot_ms": alone_tpot,
                    "tpot_ratio": tpot / alone_tpot if tpot and alone_tpot else None,
                    "spin_alone_itl_ms": base_itl, "tok_s": med(arm, kind, model, "tok_s"),
                    "alone_tok_s": med(arm, "alone", model, "tok_s"), "models_tok_s": together,
                })
    return {"rows": rows}


COLUMNS = [
    Column("arm"), Column("phase"), Column("model"), Column("alone_itl_ms", "gap alone ms", "{:.1f}"),
    Column("itl_ms", "gap together ms", "{:.1f}"), Column("ratio", "gap ratio", "{:.2f}x"),
    Column("alone_tpot_ms", "TPOT alone ms", "{:.1f}"), Column("tpot_ms", "TPOT together ms", "{:.1f}"),
    Column("tpot_ratio", "TPOT ratio", "{:.2f}x"), Column("spin_alone_itl_ms", "`off` alone gap ms", "{:.1f}"),
    Column("alone_tok_s", "tok/s alone", "{:.0f}"), Column("tok_s", "tok/s together", "{:.0f}"),
    Column("models_tok_s", "all models' tok/s", "{:.0f}"),
]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="divide,off,passive")
    p.add_argument("--users", type=int, default=4, help="closed-loop streams per model")
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--four", action="store_true", help="also drive all four models at once")
    p.add_argument("--out", default="reports/shared_served.json")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if not arms or set(arms) - set(ARMS):
        p.error(f"--arms from {', '.join(ARMS)}; got {args.arms!r}")
    record = Record.start("python -m bench.shared_served", vars(args))
    result = run(arms, args.users, args.phase_s, args.rounds, args.max_tokens, args.four)
    record.add_table("shared_served", COLUMNS, result["rows"])
    write_result(result, record, "shared_served", args.out)


if __name__ == "__main__":
    main()
