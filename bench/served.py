"""The served column of ``make bench``: the benchmark's decode workloads sent through a real tritonserver.

A workload is ``batch`` streams started together, each a prompt of about ``prompt_len`` tokens and exactly
``new_tokens`` new ones (``ignore_eos``), greedy or sampled. Each stream is one gRPC bidirectional stream, as a
tritonclient user sends it; all are opened before the first request goes out, so that a batcher sees them together.
The inter-token latency (ITL) is the median gap between two consecutive tokens of a stream, over every stream once
the first two tokens are out (prefill done): one engine step as a client sees it, transport included. A response
that carries k tokens (``stream_interval``: sent every few steps) counts as k gaps of 1/k of the time since the
stream's previous response: the time per token at which the stream delivers, the same figure as before when every
response carries one token. TTFT is the median over streams of the first response's arrival.

The client runs in this process, on the same cores as the server, as a load generator would; the CPU it used and
the server's (tritonserver and its stubs) are reported beside each workload, so a server that starves its
neighbours shows.
"""

from __future__ import annotations

import functools
import queue
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tritonclient.grpc as grpcclient

from backend.contract.names import CONTINUOUS, DYNAMIC
from backend.triton.launcher import config_text
from backend.triton.launcher.processes import process_group_members
from backend.triton.launcher.server import TritonServer, start_on_free_ports
from client.schema import GenerationRequest, build_inputs

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVED_MODELS = (CONTINUOUS, DYNAMIC)
# The dynamic batcher waits this long for a whole workload's requests (they are sent back to back, within
# milliseconds; the shipped 2 ms would split a batch of 64 and serialise it).
BATCHER_DELAY_US = 200_000
_CPUCLOCK_SCHED = 2  # the kernel's id of a process's whole CPU time among its CPU-time clocks


@dataclass(frozen=True)
class ServedWorkload:
    model: str
    batch: int
    temperature: float
    new_tokens: int


def served_repository(
    out_dir: Path,
    models: tuple[str, ...],
    max_num_seqs: int,
    dtype: str = "bfloat16",
    max_model_len: int = 2048,
    quantization: str | None = None,
) -> Path:
    """A copy of the shipped models in ``dtype`` (weights quantized to ``quantization`` when given: the engine
    parameter) with room for ``max_num_seqs`` sequences (a batcher that size)."""
    repository = out_dir / "model_repository"
    for model in models:
        source = REPO_ROOT / "model_repository" / model
        config = config_text.load(source / "config.pbtxt")
        # NOTE: the shipped parameters must be there to be set (one that disappeared would otherwise go unnoticed).
        config_text.set_parameters(config, {"dtype": dtype, "max_num_seqs": max_num_seqs,
                                            "max_model_len": max_model_len,
                                            "max_num_batched_tokens": max(2048, max_num_seqs * 64)},
                                   add_missing=False)
        if quantization is not None:
            config_text.set_parameters(config, {"quantization": quantization})
        if config.max_batch_size:  # batched by Triton: as many seats in its batcher
            config_text.set_max_batch_size(config, max_num_seqs)
            config_text.dynamic_batching(config).max_queue_delay_microseconds = BATCHER_DELAY_US
        (repository / model / "1").mkdir(parents=True, exist_ok=True)
        config_text.save(config, repository / model / "config.pbtxt")
        shutil.copy((source / "1" / "model.py").resolve(), repository / model / "1" / "model.py")
    return repository


def text_prompts(tokenizer, num: int, length: int, seed: int) -> list[str]:
    """Prompts of about ``length`` tokens: random vocabulary ids, decoded (the offline bench sends the ids)."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    prompts = []
    for _ in range(num):
        ids = [rng.randrange(100, vocab - 100) for _ in range(length)]
        prompts.append(tokenizer.decode(tokenizer.encode(tokenizer.decode(ids))[:length]))
    return prompts


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time the processes ``pids`` have used so far (all their threads, ended ones included), to the nanosecond;
    a process that is gone counts 0.

    NOTE: read from each process's CPU-time clock, not /proc/PID/stat, whose utime and stime count 10 ms clock ticks:
    a short workload's server used less than one tick between two readings and read 0.0 (CI, a four-token run). The
    clock id is Linux's ``clock_getcpuclockid(pid)``, which Python does not wrap: ``(~pid << 3) | CPUCLOCK_SCHED``.
    """
    total = 0.0
    for pid in pids:
        try:
            total += time.clock_gettime((~pid << 3) | _CPUCLOCK_SCHED)
        except OSError:  # gone
            continue
    return total


def run_workload(server: TritonServer, workload: ServedWorkload, prompts: list[str], seed: int,
                 timeout: float = 300.0) -> dict:
    """Send the workload's streams together and return its ITL and the CPU the client and the server used."""
    max_batch_size = 0 if workload.model == CONTINUOUS else workload.batch
    streams = []
    for i, prompt in enumerate(prompts[: workload.batch]):
        request = GenerationRequest(prompt, max_tokens=workload.new_tokens, temperature=workload.temperature,
                                    seed=seed + i, ignore_eos=True, stream=True)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        responses: queue.SimpleQueue = queue.SimpleQueue()
        client.start_stream(callback=functools.partial(_on_response, responses))
        streams.append((client, responses, build_inputs(request, max_batch_size)))
    server_pids = process_group_members(server.pid)
    client_cpu, server_cpu, started = _own_cpu_seconds(), _cpu_seconds(server_pids), time.perf_counter()
    for client, _, inputs in streams:
        client.async_stream_infer(workload.model, inputs, enable_empty_final_response=True)
    token_times: list[list[float]] = []
    first_times: list[float] = []
    num_responses = 0
    try:
        for _, responses, _ in streams:
            times: list[float] = []
            while True:
                arrived, result, error = responses.get(timeout=timeout)
                if error is not None:
                    raise RuntimeError(f"{workload.model}: {error}")
                ids = result.as_numpy("output_ids")
                if ids is not None and ids.size:
                    if not times:
                        first_times.append(arrived)
                    times += spread_tokens(times[-1] if times else started, arrived, int(ids.size))
                    num_responses += 1
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            token_times.append(times)
    finally:
        for client, _, _ in streams:
            client.stop_stream()
            client.close()
    wall = max(t[-1] for t in token_times if t) - started
    client_cpu, server_cpu = _own_cpu_seconds() - client_cpu, _cpu_seconds(server_pids) - server_cpu
    if any(len(t) != workload.new_tokens for t in token_times):
        raise RuntimeError(f"{workload.model}: a stream did not return exactly {workload.new_tokens} tokens")
    skip = 2 if workload.new_tokens > 3 else 0  # the first tokens may share steps with the others' prefill
    gaps = sorted(b - a for t in token_times for a, b in zip(t[skip:], t[skip + 1:]))
    return {
        "itl_ms": statistics.median(gaps) * 1e3,
        "itl_p90_ms": gaps[int(0.9 * (len(gaps) - 1))] * 1e3,
        "tok_s": workload.batch * workload.new_tokens / wall,
        "ttft_ms": statistics.median(t - started for t in first_times) * 1e3,
        "tokens_per_response": workload.batch * workload.new_tokens / num_responses,
        "client_cpu": client_cpu / wall,  # cores (1.0 = one core busy)
        "server_cpu": server_cpu / wall,
    }


def spread_tokens(previous: float, arrived: float, num_tokens: int) -> list[float]:
    """The arrival times counted for a response of ``num_tokens`` tokens that came at ``arrived``, the stream's
    previous response at ``previous``: evenly spread over the gap, the last at ``arrived``."""
    return [previous + (arrived - previous) * (i + 1) / num_tokens for i in range(num_tokens)]


def _on_response(responses: queue.SimpleQueue, result, error) -> None:
    responses.put((time.perf_counter(), result, error))


def _own_cpu_seconds() -> float:
    return time.process_time()  # this process, all threads, to the nanosecond (os.times counts clock ticks)


def served_column(
    model_dir: str,
    dtype: str,
    models: tuple[str, ...],
    batches: tuple[int, ...],
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    seed: int,
    offline_rows: list[dict],
    log=print,
    quantization: str | None = None,
) -> dict:
    """Every (model, batch, greedy or temperature 1.0) workload through one server, best ITL of ``repeats``, beside
    the offline engine's median decode step for the same batch and sampling (``offline_rows`` from the fixed
    batches): ``ratio`` is served ITL / offline step. Models alternate at each point, so background load hits both."""
    from backend.engine.tokenizer import load_tokenizer

    offline = {row["batch"]: row for row in offline_rows}
    best: dict[tuple[str, int, float], dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-served-") as tmp:
        # Room for the prompts (text re-encoded: a few tokens more or less than prompt_len) and the new tokens.
        max_model_len = 2 * prompt_len + new_tokens + 64
        repository = served_repository(Path(tmp), models, max(batches), dtype, max_model_len, quantization)
        prompts = text_prompts(load_tokenizer(model_dir).hf, max(batches), prompt_len, seed)
        server = start_on_free_ports(repository, model=model_dir, extra_args=["--exit-timeout-secs", "5"],
                                     log_path=Path(tmp) / "tritonserver.log")
        try:
            server.wait_ready(timeout=300)
            for model in models:  # warm-up: first requests pay one-time costs
                run_workload(server, ServedWorkload(model, 2, 0.0, 4), prompts, seed)
            for _ in range(repeats):
                for batch in batches:
                    for temperature in (0.0, 1.0):
                        for model in models:
                            result = run_workload(server, ServedWorkload(model, batch, temperature, new_tokens),
                                                  prompts, seed)
                            key = (model, batch, temperature)
                            if key not in best or result["itl_ms"] < best[key]["itl_ms"]:
                                best[key] = result
                log(f"      served: {len(best)} workloads, "
                    + ", ".join(f"{m} B={b} T={t:g} {r['itl_ms']:.1f} ms" for (m, b, t), r in best.items() if b == 1))
        finally:
            server.stop()
    runs = []
    for (model, batch, temperature), result in best.items():
        row = offline[batch]
        step = row["engine_decode_step_ms"] if temperature == 0 else row["sampled_decode_step_ms"]
        runs.append({"model": model, "batch": batch, "temperature": temperature, **result,
                     "offline_step_ms": step, "ratio": result["itl_ms"] / step})
    return {"models": list(models), "new_tokens": new_tokens, "prompt_len": prompt_len,
            "quantization": quantization, "runs": runs}
