"""vLLM beside the Triton models, measured with vLLM's own client: ``vllm bench serve`` at 1 to 64 concurrent streams
against vLLM's CPU build and against each Triton model behind the project's OpenAI frontend, each server alone on the
machine (``make peer-sweep``; ``make vllm-venv`` builds vLLM's environment first).

    python -m bench.peer_sweep [--servers vllm,llm_continuous,llm_iterative,llm_dynamic] [--concurrency 1,8,16,32,64]
        [--vllm-seats default,8] [--stream-intervals auto,1] [--repeats 1] [--smoke] [--out reports/peer-sweep-<time>]

The servers: vLLM (``loadtest/vllm_peer/server.py``, its settings recorded) at each of ``--vllm-seats`` (its own
default, and 8 as Triton's batchers ship), and each Triton model at each of ``--stream-intervals`` (the engine's
``stream_interval``: ``auto`` as shipped, and 1, every token sent as vLLM sends it), served as ``make serve`` serves
it (``loadtest.served.Served``: tritonserver on a copy of the repository holding that model alone, the frontend
beside it). One server is started, swept at every concurrency and stopped before the next starts; every other repeat
runs them in the reverse order, so what drifts on the machine during a sweep falls on all of them alike.

The load is the same for every server: vLLM's random dataset, 128-token prompts, exactly 128 tokens out
(``--ignore-eos``), greedy, the same prompts, 8 prompts per stream of ``--max-concurrency``, after one round of warm-up
requests at that concurrency; each run's result is saved in the report folder (``results/``). Per server and
concurrency the record (``record.json``, table ``peer_sweep``) holds output tok/s, requests/s, TTFT, TPOT and ITL
p50 and p99, the failures, the CPU the server's processes used per output token (in all and by process: where a
server's time goes) (medians over the repeats), and the ratios to the baseline, the first vLLM server, at the same
concurrency. A full sweep's record is kept as ``records/runs/peer-sweep-<cpu>.json`` for ``make tables``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from backend.contract.names import CONTINUOUS, DYNAMIC, ITERATIVE
from backend.contract.settings import DEFAULT_MODEL
from backend.triton.launcher.processes import kill_process_group
from loadtest.peer_rows import seat_counts
from loadtest.runner import batcher_settings, http_json, served_parameter, served_repository
from loadtest.served import Served
from loadtest.signals import exit_on_sigterm
from loadtest.soak import client_counts, names_list
from loadtest.vllm_peer.server import VENV, VllmServer, VllmSettings, all_cores, best_dtype
from records.record import Column, Record, format_value

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_CLI = REPO_ROOT / "loadtest" / "vllm_peer" / "vllm_cli.py"
VLLM = "vllm"
SERVERS = (VLLM, CONTINUOUS, ITERATIVE, DYNAMIC)
STREAM_INTERVAL = "stream_interval"
RECORD_NAME = "peer-sweep"  # records/runs/peer-sweep-<cpu>.json
BENCH_TIMEOUT_S = 1800.0  # one `vllm bench serve` run: 512 prompts at 64 streams take minutes on 2 cores

# Our name for each figure -> the key of vllm bench serve's saved result (with --metric-percentiles 50,99).
RESULT_KEYS = {
    "output_tok_s": "output_throughput", "req_s": "request_throughput",
    "ttft_p50_ms": "p50_ttft_ms", "ttft_p99_ms": "p99_ttft_ms",
    "tpot_p50_ms": "p50_tpot_ms", "tpot_p99_ms": "p99_tpot_ms",
    "itl_p50_ms": "p50_itl_ms", "itl_p99_ms": "p99_itl_ms",
}  # fmt: skip
# What each of a server's processes does, by a marker in its name or command line (the first that matches): the
# Triton models' engine runs in the Python backend's stub, which also sends every response; vLLM's forward runs in
# its worker, its scheduler and the outputs of every step in its engine core, the OpenAI API in its API server.
PROCESS_ROLES = (
    ("triton_python_backend_stub", "stub"), ("tritonserver", "tritonserver"), ("frontend.openai", "frontend"),
    ("VLLM::EngineCore", "engine core"), ("VLLM::Worker", "worker"), ("vllm", "API server"),
)  # fmt: skip
# Each figure set beside the baseline's: (our key, the ratio's key). A ratio above 1 is more tokens/s, or a longer wait.
RATIOS = (("output_tok_s", "tok_s_vs_vllm"), ("ttft_p50_ms", "ttft_p50_vs_vllm"), ("ttft_p99_ms", "ttft_p99_vs_vllm"),
          ("tpot_p99_ms", "tpot_p99_vs_vllm"))
COLUMNS = [
    Column("server"), Column("seats"), Column("stream_interval", "stream interval"), Column("concurrency"),
    Column("output_tok_s", "tok/s", "{:.1f}"), Column("req_s", "req/s", "{:.2f}"),
    Column("ttft_p50_ms", "TTFT p50", "ms"), Column("ttft_p99_ms", "TTFT p99", "ms"),
    Column("tpot_p50_ms", "TPOT p50", "{:.1f} ms"), Column("tpot_p99_ms", "TPOT p99", "{:.1f} ms"),
    Column("itl_p50_ms", "ITL p50", "{:.1f} ms"), Column("itl_p99_ms", "ITL p99", "{:.1f} ms"),
    Column("failed"),
    Column("server_cpu_ms_per_token", "server CPU per token", "{:.2f} ms"),
    Column("server_cpu_by_process", "by process (ms per token)"),
    Column("tok_s_vs_vllm", "tok/s vs vLLM", "{:.2f}x"), Column("ttft_p50_vs_vllm", "TTFT p50 vs vLLM", "{:.2f}x"),
    Column("ttft_p99_vs_vllm", "TTFT p99 vs vLLM", "{:.2f}x"),
    Column("tpot_p99_vs_vllm", "TPOT p99 vs vLLM", "{:.2f}x"),
]  # fmt: skip


@dataclass(frozen=True)
class Load:
    """What ``vllm bench serve`` sends at each concurrency: ``prompts_per_concurrency`` prompts per stream (or
    ``num_prompts`` at every concurrency) of ``input_len`` random tokens, each answered with exactly ``output_len``.
    Each concurrency draws its prompts with its own seed (``seed`` + concurrency): the same prompts for every server,
    none of them sent again at another concurrency, where vLLM's prefix cache (on by default) would find them."""

    concurrencies: tuple[int, ...] = (1, 8, 16, 32, 64)
    input_len: int = 128
    output_len: int = 128
    prompts_per_concurrency: int = 8
    num_prompts: int | None = None
    seed: int = 0

    def prompts_at(self, concurrency: int) -> int:
        return self.num_prompts or self.prompts_per_concurrency * concurrency

    def seed_at(self, concurrency: int) -> int:
        return self.seed + concurrency


SMOKE = Load(concurrencies=(1, 2), output_len=16, num_prompts=4)


@dataclass(frozen=True)
class Peer:
    """One server of the sweep: vLLM with ``seats`` (None: its default), or a Triton model behind the OpenAI frontend
    with ``stream_interval``."""

    server: str
    seats: int | None = None
    stream_interval: str | None = None

    @property
    def is_vllm(self) -> bool:
        return self.server == VLLM

    @property
    def slug(self) -> str:
        """Its name in file names: ``vllm-default``, ``vllm-8``, ``llm_continuous-interval-auto``."""
        return f"{VLLM}-{self.seats or 'default'}" if self.is_vllm else f"{self.server}-interval-{self.stream_interval}"

    @property
    def label(self) -> str:
        if self.is_vllm:
            return f"{VLLM} ({self.seats or 'default'} seats)"
        return f"{self.server} (stream_interval {self.stream_interval})"


def peers(servers: list[str], vllm_seats: list[int | None], stream_intervals: list[str]) -> list[Peer]:
    """Every server of the sweep, in the order given: vLLM at each seat count, each Triton model at each interval."""
    found = []
    for server in servers:
        if server == VLLM:
            found += [Peer(VLLM, seats=seats) for seats in vllm_seats]
        else:
            found += [Peer(server, stream_interval=interval) for interval in stream_intervals]
    return found


def run_order(sweep: list[Peer], repeat: int) -> list[Peer]:
    """The servers of repeat ``repeat`` in the order they run: as given, then reversed, by turns."""
    return list(sweep) if repeat % 2 == 0 else list(reversed(sweep))


def bench_command(python: Path, base_url: str, model: str, tokenizer: Path, concurrency: int, load: Load,
                  result_dir: Path, result_filename: str) -> list[str]:
    """``vllm bench serve`` (through ``vllm_cli.py``) against the OpenAI server at ``base_url``: streamed
    ``/v1/completions`` for ``model``, vLLM's random dataset tokenized with ``tokenizer``, greedy, ``--ignore-eos``,
    one round of warm-up at the concurrency, its result saved as ``result_dir/result_filename``."""
    return [
        str(python), "-P", str(VLLM_CLI), "bench", "serve",
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(load.input_len),
        "--random-output-len", str(load.output_len), "--random-range-ratio", "0",
        "--seed", str(load.seed_at(concurrency)),
        "--num-prompts", str(load.prompts_at(concurrency)), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--temperature", "0", "--num-warmups", str(concurrency),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", result_filename, "--disable-tqdm",
    ]  # fmt: skip


def figures(result: dict) -> dict:
    """The figures of one saved ``vllm bench serve`` result (its JSON): throughput, latency percentiles, failures."""
    found = {name: result.get(key) for name, key in RESULT_KEYS.items()}
    return {**found, "completed": int(result.get("completed") or 0), "failed": int(result.get("failed") or 0),
            "output_tokens": result.get("total_output_tokens"), "duration_s": result.get("duration")}


def run_bench(command: list[str], log_path: Path, result_path: Path, num_prompts: int,
              timeout: float = BENCH_TIMEOUT_S) -> dict:
    """One ``vllm bench serve``: its figures, or, when it did not finish, an ``error`` with every prompt failed."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = process.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_process_group(process.pid)
            process.wait()
            status = f"killed after {timeout:g} s"
    if status == 0 and result_path.exists():
        return figures(json.loads(result_path.read_text()))
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
    return {"completed": 0, "failed": num_prompts, "error": f"vllm bench serve exited {status} ({log_path}):\n{tail}"}


def process_role(name: str, command_line: list[str]) -> str:
    """What one of a server's processes does (:data:`PROCESS_ROLES`), else its name."""
    text = " ".join([name, *command_line])
    return next((role for marker, role in PROCESS_ROLES if marker in text), name)


def server_cpu(roots: list[int | None]) -> dict[str, float]:
    """CPU seconds used so far (user and system, every thread) by the processes of the trees rooted at ``roots``,
    summed by :func:`process_role`. A process that has ended is not counted."""
    import psutil

    used: dict[str, float] = {}
    for root in filter(None, roots):
        try:
            tree = [psutil.Process(root)]
            tree += tree[0].children(recursive=True)
        except psutil.Error:
            continue
        for process in tree:
            try:
                times, role = process.cpu_times(), process_role(process.name(), process.cmdline())
            except psutil.Error:
                continue
            used[role] = used.get(role, 0.0) + times.user + times.system
    return used


def cpu_per_token(before: dict[str, float], after: dict[str, float], output_tokens: int | None) -> dict:
    """What a server's processes spent on one run, in CPU milliseconds per output token the client counted: in all,
    and by role. NOTE: the run's warm-up round (a request per stream) is served within it and not counted by the
    client, so the figures are 1/``prompts_per_concurrency`` high, alike for every server."""
    if not output_tokens:
        return {}
    by_role = {role: 1000 * (after[role] - before.get(role, 0.0)) / output_tokens for role in sorted(after)}
    return {"server_cpu_ms_per_token": sum(by_role.values()), "cpu_ms_per_token_by_process": by_role}


def outcome(run: dict, output_len: int) -> str:
    """One run in a line of the sweep's log; a server that answered other than ``output_len`` tokens a request (it
    ignored ``ignore_eos``) is named."""
    if "error" in run:
        return run["error"].splitlines()[0]
    expected = run["completed"] * output_len
    return (f"{format_value(run['output_tok_s'], '{:.1f}')} tok/s, TTFT p50 {format_value(run['ttft_p50_ms'], 'ms')}, "
            f"TPOT p99 {format_value(run['tpot_p99_ms'], '{:.1f} ms')}, "
            f"server CPU {format_value(run.get('server_cpu_ms_per_token'), '{:.2f} ms')} a token, "
            f"{run['failed']} failed"
            + (f"; {run['output_tokens']} tokens out, not {expected}" if run.get("output_tokens") != expected else ""))


@contextlib.contextmanager
def serving(peer: Peer, args: argparse.Namespace, out: Path, repeat: int) -> Iterator[tuple[str, str, dict, list]]:
    """``peer`` started alone: its OpenAI base URL, the model name its requests carry, its settings (a dict,
    completed with how it stopped once it has) and the pids of its processes' roots; stopped on exit."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if peer.is_vllm:
        settings = VllmSettings(model=args.model, max_num_seqs=peer.seats, venv=args.vllm_venv,
                                kv_cache_space_gib=args.vllm_kv_cache_space, dtype=args.vllm_dtype or best_dtype(),
                                omp_threads_bind=args.vllm_omp_threads_bind or all_cores())
        server = VllmServer(settings, log_path=logs / f"{peer.slug}-r{repeat}.log")
        with server:
            recorded = server.record()
            yield server.url, settings.served_model_name, recorded, [server.pid]
        recorded["exit_status"] = server.process.returncode
        return
    repository = out / "repositories" / peer.slug
    if not repository.exists():
        served_repository(args.model_repository, repository, [peer.server], [], {STREAM_INTERVAL: peer.stream_interval})
    served = Served(repository, model=args.model, out=logs, exit_timeout=30.0, openai=True,
                    name=f"{peer.slug}-r{repeat}")
    recorded = {}
    try:
        ready_s = served.start()
        config = http_json(f"{served.http_url}/v2/models/{peer.server}/config")
        recorded.update(batcher_settings(config), stream_interval=served_parameter(config, STREAM_INTERVAL),
                        ready_s=round(ready_s, 1))
        yield served.openai_url, peer.server, recorded, [served.pid, served.frontend and served.frontend.pid]
    finally:
        recorded["stop"] = asdict(served.stop())


def sweep_peer(peer: Peer, repeat: int, args: argparse.Namespace, load: Load, out: Path,
               log=print) -> tuple[list[dict], dict]:
    """``peer`` started, loaded at every concurrency in turn, stopped: a run per concurrency, and its settings. A
    server that does not start or dies leaves its concurrencies failed, with the reason; the sweep goes on."""
    python = Path(args.vllm_venv) / "bin" / "python"
    runs, settings = [], {}
    try:
        with serving(peer, args, out, repeat) as (base_url, model, settings, pids):
            log(f"  {peer.label} ready at {base_url} in {settings.get('ready_s')} s")
            for concurrency in load.concurrencies:
                started, result_dir = time.monotonic(), out / "results" / peer.slug
                name = f"r{repeat}-c{concurrency}"
                command = bench_command(python, base_url, model, args.model, concurrency, load, result_dir,
                                        f"{name}.json")
                before = server_cpu(pids)
                run = run_bench(command, out / "logs" / f"{peer.slug}-{name}-bench.log", result_dir / f"{name}.json",
                                load.prompts_at(concurrency), args.bench_timeout)
                run.update(cpu_per_token(before, server_cpu(pids), run.get("output_tokens")))
                runs.append({"peer": peer.slug, "repeat": repeat, "concurrency": concurrency, **run})
                log(f"    {concurrency} streams: {outcome(run, load.output_len)} ({time.monotonic() - started:.0f} s)")
    except Exception as exc:  # NOTE: reported, not raised: one server that cannot start does not end the sweep
        error = f"{peer.label}: {type(exc).__name__}: {exc}"
        log(f"    failed: {error.splitlines()[0]}")
        done = {run["concurrency"] for run in runs}
        runs += [{"peer": peer.slug, "repeat": repeat, "concurrency": c, "completed": 0,
                  "failed": load.prompts_at(c), "error": error} for c in load.concurrencies if c not in done]
    return runs, settings


def summarize(runs: list[dict], sweep: list[Peer], load: Load, settings: dict[str, dict]) -> list[dict]:
    """One row per server and concurrency: the median of each figure over the repeats that measured it, the failures
    of all of them, and the ratios to the baseline (the first vLLM server) at the same concurrency."""
    rows = []
    for peer in sweep:
        seats = str(peer.seats or "default") if peer.is_vllm else settings.get(peer.slug, {}).get("max_num_seqs")
        for concurrency in load.concurrencies:
            cell = [r for r in runs if r["peer"] == peer.slug and r["concurrency"] == concurrency]
            measured = [r for r in cell if "error" not in r]
            row = {"server": peer.server, "seats": seats, "stream_interval": peer.stream_interval,
                   "concurrency": concurrency, "failed": sum(r["failed"] for r in cell)}
            for key in [*RESULT_KEYS, "server_cpu_ms_per_token"]:
                values = [r[key] for r in measured if r.get(key) is not None]
                row[key] = statistics.median(values) if values else None
            row["server_cpu_by_process"] = cpu_by_process(measured)
            rows.append((peer, row))
    baseline = next((peer for peer in sweep if peer.is_vllm), None)
    base_rows = {row["concurrency"]: row for peer, row in rows if peer == baseline}
    for _, row in rows:
        base = base_rows.get(row["concurrency"], {})
        for key, ratio in RATIOS:
            if row.get(key) is not None and base.get(key):
                row[ratio] = row[key] / base[key]
    return [row for _, row in rows]


def cpu_by_process(runs: list[dict]) -> str | None:
    """``stub 3.88, frontend 0.09, ...``: each role's median CPU milliseconds per output token over ``runs``, the
    largest first; None when no run measured it."""
    by_role: dict[str, list[float]] = {}
    for run in runs:
        for role, ms in (run.get("cpu_ms_per_token_by_process") or {}).items():
            by_role.setdefault(role, []).append(ms)
    medians = {role: statistics.median(values) for role, values in by_role.items()}
    shown = [f"{role} {ms:.2f}" for role, ms in sorted(medians.items(), key=lambda item: -item[1]) if ms >= 0.005]
    return ", ".join(shown) or None


# ---- the command line -----------------------------------------------------------------------------------------


def stream_intervals(text: str) -> list[str]:
    """``auto,1`` -> ["auto", "1"] (the engine's stream_interval: auto or a whole number of steps)."""
    chosen = [part.strip().lower() for part in text.split(",") if part.strip()]
    if not chosen or any(part != "auto" and not (part.isdigit() and int(part) >= 1) for part in chosen):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated stream intervals (auto or steps >= 1)")
    return chosen


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.peer_sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=names_list(SERVERS), default=list(SERVERS),
                        help=f"comma-separated, in this order (default: {','.join(SERVERS)})")
    parser.add_argument("--concurrency", type=client_counts, default=list(Load.concurrencies),
                        help="streams at once, one run each (default: 1,8,16,32,64)")
    parser.add_argument("--vllm-seats", type=seat_counts, default=[None, 8],
                        help="vLLM's max_num_seqs, a server each: default (vLLM's own) or a number "
                        "(default: default,8)")
    parser.add_argument("--stream-intervals", type=stream_intervals, default=["auto", "1"],
                        help="each Triton model's stream_interval, a server each (default: auto,1)")
    parser.add_argument("--repeats", type=int, default=1, help="sweeps, the order reversed every other one")
    parser.add_argument("--input-len", type=int, default=Load.input_len)
    parser.add_argument("--output-len", type=int, default=Load.output_len)
    parser.add_argument("--prompts-per-concurrency", type=int, default=Load.prompts_per_concurrency)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true",
                        help="a short check: concurrency 1 and 2, 4 prompts of 16 tokens out, each server once (vLLM "
                        "at the first of --vllm-seats, each model at the first of --stream-intervals)")
    parser.add_argument("--model", type=Path, default=Path(os.environ.get("MODEL") or DEFAULT_MODEL),
                        help="HF model folder: served by every server, and the client's tokenizer")
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--vllm-venv", type=Path, default=VENV, help="vLLM's environment (make vllm-venv)")
    parser.add_argument("--vllm-omp-threads-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND (default: every core; auto: vLLM's own choice)")
    parser.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default=None,
                        help="vLLM's --dtype (default: bfloat16 where the CPU has AVX512-BF16, else float32, its best)")
    parser.add_argument("--vllm-kv-cache-space", type=int, default=VllmSettings.kv_cache_space_gib,
                        help="VLLM_CPU_KVCACHE_SPACE, GiB (default: %(default)s)")
    parser.add_argument("--bench-timeout", type=float, default=BENCH_TIMEOUT_S,
                        help="seconds one vllm bench serve run may take (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default: reports/peer-sweep-<time>)")
    parser.add_argument("--keep", action=argparse.BooleanOptionalAction, default=None,
                        help="keep the record as records/runs/peer-sweep-<cpu>.json (default: a full sweep's)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    args.model = args.model.resolve()  # NOTE: the servers and the client run in folders of their own
    if args.smoke:
        args.vllm_seats, args.stream_intervals = args.vllm_seats[:1], args.stream_intervals[:1]
    return args


def load_of(args: argparse.Namespace) -> Load:
    if args.smoke:
        return SMOKE
    return Load(tuple(args.concurrency), args.input_len, args.output_len, args.prompts_per_concurrency, seed=args.seed)


def main(argv=None) -> int:
    args = parse_args(argv)
    load = load_of(args)
    python = Path(args.vllm_venv) / "bin" / "python"
    if not python.exists():
        print(f"{python} not found: `make vllm-venv` builds vLLM's environment", file=sys.stderr)
        return 2
    out = args.out or REPO_ROOT / "reports" / time.strftime("peer-sweep-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    sweep = peers(args.servers, args.vllm_seats, args.stream_intervals)
    record = Record.start("make peer-sweep", {**vars(args), "load": asdict(load), "servers": [p.label for p in sweep]},
                          measure_bandwidth=False)
    print(f"[peer-sweep] {len(sweep)} servers x {len(load.concurrencies)} concurrencies x {args.repeats} repeat(s): "
          f"{', '.join(p.label for p in sweep)}; report in {out}", flush=True)
    runs, settings = [], {}
    for repeat in range(args.repeats):
        for peer in run_order(sweep, repeat):
            print(f"[peer-sweep] repeat {repeat + 1}/{args.repeats}: {peer.label}", flush=True)
            peer_runs, peer_settings = sweep_peer(peer, repeat, args, load, out,
                                                  log=lambda line: print(line, flush=True))
            runs += peer_runs
            if peer_settings:  # NOTE: a repeat whose server did not start keeps the settings of one that did
                settings[peer.slug] = peer_settings
    rows = summarize(runs, sweep, load, settings)
    record.settings["peers"] = settings
    baseline = next((p.label for p in sweep if p.is_vllm), None)
    record.notes += [
        f"Ratios are to {baseline} at the same concurrency: tok/s above 1x is more, a latency above 1x is longer."
        if baseline else "No vLLM server in this sweep: no ratios.",
        "vLLM's default seats are its own max_num_seqs default (128 for its OpenAI server on CPU, as of 0.32).",
        "TTFT, TPOT and ITL are vLLM's client's: ITL is the gap between two streamed chunks (a chunk that carries "
        "several tokens counts once), TPOT a request's time after its first token over its other tokens.",
    ]
    table = record.add_table("peer_sweep", COLUMNS, rows, title="vllm bench serve against each server, alone")
    (out / "peer_sweep.json").write_text(json.dumps({"load": asdict(load), "settings": settings, "runs": runs},
                                                    indent=1) + "\n")
    record.write(out / "record.json")
    print(table.markdown())
    print(f"[peer-sweep] runs: {out / 'peer_sweep.json'}; the record: {out / 'record.json'}")
    full = not args.smoke and set(args.servers) == set(SERVERS)
    if args.keep or (args.keep is None and full):
        kept = record.write(record.kept_path(RECORD_NAME))
        print(f"[peer-sweep] record kept: {kept.relative_to(REPO_ROOT)}")
    return 0 if not any(row["failed"] for row in rows) else 1


if __name__ == "__main__":
    exit_on_sigterm()  # the servers it started are stopped, not left running
    sys.exit(main())
