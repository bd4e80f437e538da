"""The OpenAI frontend's own cost, beside direct gRPC to the same Triton model, in one run (a benchmark, not a test).

    python -m bench.frontend_overhead [--model-dir models/smollm2-135m-instruct] [--rounds 8] [--tokens 128] \
        [--out reports/bench_frontend_overhead.json]

Starts tritonserver (``llm_continuous`` only) and the frontend beside it, then at 1 and 8 concurrent streams sends
rounds of requests (each exactly ``--tokens`` new tokens, ``ignore_eos``, greedy, the same prompt) straight to
Triton's gRPC stream (tritonclient) and through the frontend's streamed ``/v1/chat/completions`` (one content chunk
per token), the two paths alternating (ABBA), so background load hits both alike. Both clients run on threads of
this process and keep their connection between requests (a gRPC stream per thread, an HTTP connection per thread),
as benchmark clients do; each request's clock starts when its client starts building it.
Per round it takes the TTFT p50 (first token, or first content chunk) and the output tokens/s (tokens over the
round's wall time); per concurrency it prints the median of the rounds, the gRPC baseline beside the frontend. The
run's record (``records/``) goes beside the JSON (``bench_frontend_overhead.record.json``), table ``overhead``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import queue
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import tritonclient.grpc as grpcclient

from backend.contract.settings import DEFAULT_MODEL
from backend.triton.launcher.launch_options import copy_model_repository, free_ports
from backend.triton.launcher.server import start_on_free_ports
from client.grpc_stream import max_batch_size
from client.schema import GenerationRequest, build_inputs
from frontend.openai.chat_template import ChatTemplate
from frontend.openai.process import FrontendProcess
from frontend.openai.protocol import ChatMessage
from records.record import Column, Record

MODEL = "llm_continuous"
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


_local = threading.local()
IDLE_RECONNECT_S = 4.0  # below uvicorn's keep-alive timeout
_opened: list = []  # every thread's gRPC sender and HTTP connection, closed at the end


class GrpcSender:
    """This thread's gRPC client with one stream kept open, as perf_analyzer keeps its streams: each request goes
    out on the open stream, so no request pays for opening one (the strongest use of tritonclient)."""

    def __init__(self, grpc_url: str) -> None:
        self.client = grpcclient.InferenceServerClient(grpc_url)
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((time.perf_counter(), result,
                                                                                   error)))
        self.max_batch_size = max_batch_size(grpc_url, MODEL)

    def send(self, prompt: str, tokens: int) -> tuple[float, int]:
        """(TTFT s, tokens) of one request; this thread's stream carries one request at a time."""
        t0 = time.perf_counter()
        request = GenerationRequest(prompt, max_tokens=tokens, ignore_eos=True, temperature=0.0, stream=True)
        self.client.async_stream_infer(MODEL, build_inputs(request, self.max_batch_size),
                                       enable_empty_final_response=True)
        ttft, count = None, 0
        while True:
            arrived, result, error = self.responses.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"gRPC request failed: {error}")
            ids = result.as_numpy("output_ids")
            if ids is not None and ids.size:
                ttft = arrived - t0 if ttft is None else ttft
                count += ids.size
            if result.get_response().parameters["triton_final_response"].bool_param:
                return ttft, count

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def grpc_once(grpc_url: str, prompt: str, tokens: int) -> tuple[float, int]:
    if not hasattr(_local, "grpc"):
        _local.grpc = GrpcSender(grpc_url)
        _opened.append(_local.grpc)
    return _local.grpc.send(prompt, tokens)


def openai_once(url: str, tokens: int) -> tuple[float, int]:
    """(TTFT s, tokens) of one streamed chat request through the frontend, on this thread's HTTP connection (the
    standard library's: ``requests`` alone added 0.7 ms to every request here, a cost of that client, not of the
    frontend)."""
    if not hasattr(_local, "http"):
        _local.http = http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port)
        _local.http_used = 0.0
        _opened.append(_local.http)
    if time.perf_counter() - _local.http_used > IDLE_RECONNECT_S:
        # NOTE: the frontend (uvicorn) closes a connection idle for 5 s; a thread waits that long while the other
        # path's rounds run, where a client under steady load would not: it connects again before its clock starts.
        _local.http.close()
        _local.http.connect()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    _local.http.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = _local.http.getresponse()
    if response.status != 200:
        raise RuntimeError(f"OpenAI request failed: {response.status} {response.read()!r}")
    ttft, usage = None, 0
    for line in response:  # the SSE lines, as they arrive
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if ttft is None and event["choices"] and event["choices"][0]["delta"].get("content") is not None \
                and "role" not in event["choices"][0]["delta"]:
            ttft = time.perf_counter() - t0
        if event.get("usage"):
            usage = event["usage"]["completion_tokens"]
    _local.http_used = time.perf_counter()
    return ttft, usage


def run_round(pool: ThreadPoolExecutor, send, concurrency: int) -> tuple[float, float]:
    """``concurrency`` requests at once: (their TTFT p50 in ms, output tokens/s over the round)."""
    t0 = time.perf_counter()
    results = list(pool.map(lambda _: send(), range(concurrency)))
    wall = time.perf_counter() - t0
    return 1000 * statistics.median(r[0] for r in results), sum(r[1] for r in results) / wall


COLUMNS = [Column("streams"), Column("grpc_ttft_ms", "TTFT p50 gRPC", "{:.1f} ms"),
           Column("openai_ttft_ms", "TTFT p50 OpenAI", "{:.1f} ms"), Column("ttft_diff_ms", "difference", "{:+.1f} ms"),
           Column("grpc_tok_s", "tok/s gRPC", "{:.1f}"), Column("openai_tok_s", "tok/s OpenAI", "{:.1f}"),
           Column("tok_s_diff_pct", "difference", "{:+.1f} %")]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.frontend_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=DEFAULT_MODEL)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=8, help="rounds per protocol and concurrency (default: %(default)s)")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-threads", type=int, default=None,
                   help="the engine's threads (default: every core); fewer leave cores to the clients and frontend")
    p.add_argument("--out", type=Path, default=Path("reports/bench_frontend_overhead.json"))
    args = p.parse_args(argv)
    record = Record.start("python -m bench.frontend_overhead", vars(args))
    prompt = ChatTemplate(args.model_dir).render([ChatMessage(**m) for m in MESSAGES])

    with tempfile.TemporaryDirectory() as tmp:
        parameters = {} if args.num_threads is None else {"num_threads": str(args.num_threads)}
        repo = copy_model_repository(Path(tmp) / "model_repository", [MODEL], parameters)
        with start_on_free_ports(repo, model=args.model_dir, log_path=Path(tmp) / "tritonserver.log") as server, \
                FrontendProcess(server.grpc_url, free_ports(1)[0], args.model_dir,
                                log_path=Path(tmp) / "frontend.log") as frontend:
            senders = {
                "gRPC": lambda: grpc_once(server.grpc_url, prompt, args.tokens),
                "OpenAI": lambda: openai_once(frontend.url, args.tokens),
            }
            rows = []
            for concurrency in [int(c) for c in args.concurrency.split(",")]:
                rounds = {name: [] for name in senders}
                # NOTE: the same threads for every round, so each keeps its gRPC channel and HTTP connection.
                with ThreadPoolExecutor(concurrency) as pool:
                    for send in senders.values():  # warm up both paths: connections, the first steps
                        run_round(pool, send, concurrency)
                    for i in range(args.rounds):
                        order = list(senders) if i % 2 == 0 else list(reversed(senders))  # ABBA: drift hits both
                        for name in order:
                            rounds[name].append(run_round(pool, senders[name], concurrency))
                rows.append((concurrency, {n: (statistics.median(r[0] for r in rounds[n]),
                                               statistics.median(r[1] for r in rounds[n])) for n in senders}))
                print(f"  {concurrency} streams done", flush=True)
            for opened in _opened:
                opened.close()

    print(f"\nmedians of {args.rounds} rounds per cell, {args.tokens} tokens per stream, {MODEL}, "
          f"{Path(args.model_dir).name}")
    table = [{"streams": concurrency, "grpc_ttft_ms": cell["gRPC"][0], "openai_ttft_ms": cell["OpenAI"][0],
              "ttft_diff_ms": cell["OpenAI"][0] - cell["gRPC"][0], "grpc_tok_s": cell["gRPC"][1],
              "openai_tok_s": cell["OpenAI"][1], "tok_s_diff_pct": 100 * (cell["OpenAI"][1] / cell["gRPC"][1] - 1)}
             for concurrency, cell in rows]
    print(record.add_table("overhead", COLUMNS, table).markdown())
    record.write_beside(args.out, {"rows": table, "tokens": args.tokens, "rounds": args.rounds})


if __name__ == "__main__":
    main()
