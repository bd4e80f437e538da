"""The OpenAI frontend's own cost, beside direct gRPC to the same Triton model, in one run (a benchmark, not a test).

    python -m frontend.openai.bench [--model-dir models/smollm2-135m-instruct] [--rounds 6] [--tokens 128]

Starts tritonserver (``llm_continuous`` only) and the frontend beside it, then at 1 and 8 concurrent streams sends
rounds of requests (each exactly ``--tokens`` new tokens, ``ignore_eos``, greedy, the same prompt) alternately
straight to Triton's gRPC stream (tritonclient, the project's client) and through the frontend's streamed
``/v1/chat/completions`` (one content chunk per token), so background load hits both alike. Both clients run on
threads of this process. Per concurrency it prints TTFT p50 (first token, or first content chunk) and output
tokens/s (tokens over the wall time of the rounds), the gRPC baseline beside the frontend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from backend.triton.launch_options import DEFAULT_MODEL, copy_model_repository, free_ports
from backend.triton.server import start_on_free_ports
from client import grpc_stream
from frontend.openai.chat_template import ChatTemplate
from frontend.openai.process import FrontendProcess
from frontend.openai.protocol import ChatMessage

MODEL = "llm_continuous"
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def grpc_once(grpc_url: str, prompt: str, tokens: int) -> tuple[float, int]:
    """(TTFT s, tokens) of one request straight to Triton."""
    stream = grpc_stream.generate(grpc_url, MODEL, prompt, timeout=600, max_tokens=tokens, ignore_eos=True,
                                  temperature=0.0, stream=True)
    if stream.error or not stream.chunks:
        raise RuntimeError(f"gRPC request failed: {stream.error}")
    return stream.chunks[0].time_s, len(stream.token_ids)


def openai_once(session: requests.Session, url: str, tokens: int) -> tuple[float, int]:
    """(TTFT s, tokens) of one streamed chat request through the frontend."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage = None, 0
    with session.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines(chunk_size=None):
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event["choices"] and event["choices"][0]["delta"].get("content") is not None \
                    and "role" not in event["choices"][0]["delta"]:
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
    return ttft, usage


def run_round(send, concurrency: int) -> tuple[list[float], int, float]:
    """``concurrency`` requests at once: (their TTFTs, tokens in all, wall seconds)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda _: send(), range(concurrency)))
    return [r[0] for r in results], sum(r[1] for r in results), time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m frontend.openai.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=DEFAULT_MODEL)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6, help="rounds per protocol and concurrency (default: %(default)s)")
    p.add_argument("--concurrency", default="1,8")
    args = p.parse_args(argv)
    prompt = ChatTemplate(args.model_dir).render([ChatMessage(**m) for m in MESSAGES])

    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_model_repository(Path(tmp) / "model_repository", [MODEL])
        with start_on_free_ports(repo, model=args.model_dir, log_path=Path(tmp) / "tritonserver.log") as server, \
                FrontendProcess(server.grpc_url, free_ports(1)[0], args.model_dir,
                                log_path=Path(tmp) / "frontend.log") as frontend:
            session = requests.Session()
            senders = {
                "gRPC": lambda: grpc_once(server.grpc_url, prompt, args.tokens),
                "OpenAI": lambda: openai_once(session, frontend.url, args.tokens),
            }
            for send in senders.values():  # warm up both paths
                run_round(send, 2)
            rows = []
            for concurrency in [int(c) for c in args.concurrency.split(",")]:
                ttfts = {name: [] for name in senders}
                tokens = {name: 0 for name in senders}
                wall = {name: 0.0 for name in senders}
                for _ in range(args.rounds):
                    for name, send in senders.items():  # alternate, so background load hits both alike
                        round_ttfts, round_tokens, round_wall = run_round(send, concurrency)
                        ttfts[name] += round_ttfts
                        tokens[name] += round_tokens
                        wall[name] += round_wall
                rows.append((concurrency, {n: (1000 * statistics.median(ttfts[n]), tokens[n] / wall[n])
                                           for n in senders}))
                print(f"  {concurrency} streams done", flush=True)

    print(f"\n{args.rounds} rounds per cell, {args.tokens} tokens per stream, {MODEL}, {Path(args.model_dir).name}")
    print("| streams | TTFT p50 gRPC | TTFT p50 OpenAI | difference | tok/s gRPC | tok/s OpenAI | difference |")
    print("|---|---|---|---|---|---|---|")
    for concurrency, cell in rows:
        (g_ttft, g_tps), (o_ttft, o_tps) = cell["gRPC"], cell["OpenAI"]
        print(f"| {concurrency} | {g_ttft:.1f} ms | {o_ttft:.1f} ms | {o_ttft - g_ttft:+.1f} ms "
              f"| {g_tps:.1f} | {o_tps:.1f} | {100 * (o_tps / g_tps - 1):+.1f} % |")


if __name__ == "__main__":
    main()
