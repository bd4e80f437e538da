"""The llama.cpp column of ``make bench``: the benchmark's decode workloads sent to llama.cpp's ``llama-server``.

The baseline the served engine is judged against: llama.cpp on the same weights (a BF16 GGUF that ``make llamacpp``
converts from the same Hugging Face folder; with ``quantization="q4_1"`` the Q4_1 GGUF the model ships as, which
``make llamacpp`` links beside it; or any GGUF given), the same threads, prompts of ``prompt_len`` token ids and exactly
``new_tokens`` new tokens (``ignore_eos``), greedy or sampled. A workload is ``batch`` streaming ``/completion``
requests released together (one thread and one HTTP connection each) into a server with one slot per stream of the
largest batch and continuous batching on.
The inter-token latency (ITL) is measured on the client as ``bench.served`` measures it: the median gap between two
consecutive tokens of a stream, over every stream once the first two tokens are out.

Only the standard library speaks HTTP here, only to 127.0.0.1, and every read has a timeout.
"""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from backend.kernels.weight_format import WeightFormat
from bench.served import _cpu_seconds

HOST = "127.0.0.1"
TEMPERATURES = (0.0, 1.0)  # greedy, and plain sampling (no top-k/top-p/min-p cut), as the served column runs
SKIP_TOKENS = 2  # the first tokens of a stream may share steps with the other streams' prefill


@dataclass(frozen=True)
class LlamaCppWorkload:
    batch: int
    temperature: float
    new_tokens: int


# The formats ``make llamacpp`` puts a GGUF of beside the server (``<model>-<format>.gguf``): the shipped Q4_1 file
# for q4_1 (the same blocks the engine serves), and bf16 for the rest (no int8 GGUF is made: llama.cpp's Q8_0 is not
# the engine's per-channel int8, so int8 is measured against llama.cpp's BF16).
GGUF_FORMATS = (WeightFormat.BF16, WeightFormat.Q4_1)


def default_gguf(server: str | Path, model_dir: str | Path, quantization: WeightFormat | None = None) -> Path:
    """Where ``make llamacpp`` puts the GGUF of ``model_dir`` for the weight format ``quantization`` (None or
    bf16: the BF16 conversion; q4_1: the shipped Q4_1 file): beside the ``bin/`` folder of ``server``."""
    fmt = quantization if quantization in GGUF_FORMATS else WeightFormat.BF16
    return Path(server).absolute().parent.parent / f"{Path(model_dir).name}-{fmt}.gguf"


def server_command(server: str | Path, gguf: str | Path, port: int, threads: int, num_slots: int,
                   slot_context: int) -> list[str]:
    """``llama-server`` on 127.0.0.1 only: ``num_slots`` slots of ``slot_context`` tokens each, continuous batching,
    ``threads`` threads for decode and prompt alike, no prompt cache kept between requests, no web UI."""
    return [
        str(server), "--model", str(gguf), "--host", HOST, "--port", str(port),
        "--threads", str(threads), "--threads-batch", str(threads),
        "--parallel", str(num_slots), "--ctx-size", str(num_slots * slot_context), "--cont-batching",
        "--cache-ram", "0", "--no-webui",
    ]


def completion_body(prompt_ids: list[int], workload: LlamaCppWorkload, seed: int) -> dict:
    """One streaming ``/completion`` request: exactly ``new_tokens`` tokens, greedy (``top_k`` 1) or plain sampling."""
    body = {
        "prompt": prompt_ids, "n_predict": workload.new_tokens, "ignore_eos": True, "stream": True,
        "cache_prompt": False, "seed": seed, "temperature": workload.temperature,
    }
    if workload.temperature == 0:
        body["top_k"] = 1
    else:
        body.update(top_k=0, top_p=1.0, min_p=0.0)
    return body


def itl_summary(token_times: list[list[float]], started: float, new_tokens: int) -> dict:
    """Median and p90 gap between consecutive tokens of every stream (its first ``SKIP_TOKENS`` left out), and the
    output tokens per second of the whole workload from ``started`` to its last token."""
    if not token_times or any(len(t) != new_tokens for t in token_times):
        raise RuntimeError(f"llama.cpp: a stream did not return exactly {new_tokens} tokens")
    skip = SKIP_TOKENS if new_tokens > SKIP_TOKENS + 1 else 0
    gaps = sorted(b - a for t in token_times for a, b in zip(t[skip:], t[skip + 1:]))
    if not gaps:
        raise ValueError("an ITL needs at least two tokens per stream")
    wall = max(t[-1] for t in token_times) - started
    return {
        "itl_ms": statistics.median(gaps) * 1e3,
        "itl_p90_ms": gaps[int(0.9 * (len(gaps) - 1))] * 1e3,
        "tok_s": len(token_times) * new_tokens / wall,
    }


def read_stream(lines, clock=time.perf_counter, deadline: float = float("inf")) -> tuple[list[float], dict]:
    """Arrival time of each token of one server-sent event stream, and the server's ``timings`` of its last event.

    Each event says how many tokens the slot has decoded so far (``tokens_predicted``); a token held back (an
    incomplete UTF-8 character) arrives with the next event, as it would reach a user.
    """
    times: list[float] = []
    for line in lines:
        if not line.startswith(b"data: "):
            continue
        arrived = clock()
        event = json.loads(line[len(b"data: "):])
        if "error" in event:
            raise RuntimeError(f"llama.cpp: {event['error']}")
        times += [arrived] * (event.get("tokens_predicted", len(times)) - len(times))
        if event.get("stop"):
            return times, event.get("timings", {})
        if arrived > deadline:
            raise TimeoutError("llama.cpp: a stream ran past its deadline")
    raise RuntimeError("llama.cpp: the stream ended without its final event")


def _stream(port: int, body: dict, release: threading.Barrier, timeout: float) -> tuple[list[float], dict]:
    """One request on its own connection, sent when every stream of the workload is ready."""
    payload = json.dumps(body).encode()
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout)  # NOTE: bounds every read of the stream
    try:
        try:
            connection.connect()
        except OSError:
            release.abort()  # the other streams stop waiting; this error is the one reported
            raise
        release.wait(timeout)
        connection.request("POST", "/completion", body=payload, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"llama.cpp: HTTP {response.status}: {response.read(2000)!r}")
        return read_stream(iter(response.readline, b""), deadline=time.perf_counter() + timeout)
    finally:
        connection.close()


def run_workload(server: LlamaCppServer, workload: LlamaCppWorkload, prompts: list[list[int]], seed: int,
                 timeout: float = 300.0) -> dict:
    """Send the workload's streams together; its ITL, tok/s, the server's own ms per token and the CPU it used."""
    release = threading.Barrier(workload.batch + 1)
    bodies = [completion_body(prompt, workload, seed + i) for i, prompt in enumerate(prompts[: workload.batch])]
    with ThreadPoolExecutor(max_workers=workload.batch) as pool:
        futures = [pool.submit(_stream, server.port, body, release, timeout) for body in bodies]
        server_cpu = _cpu_seconds([server.pid])
        try:
            release.wait(timeout)
        except threading.BrokenBarrierError:
            pass  # a stream failed before the release: its own error is raised below
        started = time.perf_counter()
        errors = [future.exception(timeout=2 * timeout) for future in futures]
    if any(errors):
        raise next((e for e in errors if e and not isinstance(e, threading.BrokenBarrierError)), errors[0])
    streams = [future.result() for future in futures]
    summary = itl_summary([times for times, _ in streams], started, workload.new_tokens)
    wall = max(times[-1] for times, _ in streams) - started
    server_ms = [timings["predicted_per_token_ms"] for _, timings in streams if "predicted_per_token_ms" in timings]
    return {
        **summary,
        "server_ms_per_token": statistics.median(server_ms) if server_ms else None,
        "server_cpu": (_cpu_seconds([server.pid]) - server_cpu) / wall,  # cores (1.0 = one core busy)
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class LlamaCppServer:
    """A ``llama-server`` process on a free port of 127.0.0.1; ``stop`` terminates it, then kills it."""

    def __init__(self, command: list[str], port: int, log_path: Path) -> None:
        self.port, self.log_path = port, log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.pid = self.process.pid

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}:\n{self.log_tail()}")
            connection = http.client.HTTPConnection(HOST, self.port, timeout=2)
            try:
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                connection.close()
            time.sleep(0.2)
        raise TimeoutError(f"llama-server not healthy within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def server_version(server: str | Path) -> str:
    done = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    return lines[0].removeprefix("version: ") if lines else "unknown version"


def llamacpp_column(
    server: str | Path,
    model_dir: str | Path,
    threads: int,
    batches: tuple[int, ...],
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
    seed: int,
    log=print,
    gguf: str | Path | None = None,
    quantization: WeightFormat | None = None,
) -> dict:
    """Every (batch, greedy or temperature 1.0) workload through one ``llama-server``, best ITL of ``repeats``.

    ``prompts`` holds at least ``max(batches)`` prompts of token ids, all of one length. The server loads ``gguf``,
    by default :func:`default_gguf` for ``quantization``.
    """
    gguf = Path(gguf) if gguf is not None else default_gguf(server, model_dir, quantization)
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} not found: `make llamacpp MODEL={model_dir}` puts the model's GGUFs beside "
                                f"the server (or give one with --llamacpp-gguf)")
    prompt_len, port = len(prompts[0]), free_port()
    command = server_command(server, gguf, port, threads, max(batches), prompt_len + new_tokens + 64)
    best: dict[tuple[int, float], dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        process = LlamaCppServer(command, port, Path(tmp) / "llama-server.log")
        try:
            process.wait_healthy()
            run_workload(process, LlamaCppWorkload(min(2, max(batches)), 0.0, 4), prompts, seed)  # warm-up
            for _ in range(repeats):
                for batch in batches:
                    for temperature in TEMPERATURES:
                        result = run_workload(process, LlamaCppWorkload(batch, temperature, new_tokens), prompts, seed)
                        if (batch, temperature) not in best or result["itl_ms"] < best[batch, temperature]["itl_ms"]:
                            best[batch, temperature] = result
                log("      llama.cpp: "
                    + ", ".join(f"B={b} T={t:g} {r['itl_ms']:.1f} ms" for (b, t), r in best.items()))
        finally:
            process.stop()
    return {
        "server": str(server), "version": server_version(server), "gguf": str(gguf), "command": command,
        "threads": threads, "num_slots": max(batches), "prompt_len": prompt_len, "new_tokens": new_tokens,
        "runs": [{"batch": b, "temperature": t, **r} for (b, t), r in sorted(best.items())],
    }
