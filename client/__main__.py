"""Command line over :mod:`client.core`.

    python -m client generate --model llm_continuous "Tell me a story"      # streams text over gRPC
    python -m client generate --protocol http --no-stream --json "Hi"       # one /generate call, result as JSON
    python -m client models                                                 # served models, batching, readiness
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from client import DEFAULT_GRPC_URL, DEFAULT_HTTP_URL, ClientError, GenerationRequest, LLMClient

RESULT_KEYS = ("ttft_s", "tpot_s", "e2e_s", "num_input_tokens", "num_output_tokens", "finish_reason", "text")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    server = argparse.ArgumentParser(add_help=False)
    server.add_argument("--url", default=DEFAULT_GRPC_URL, help="gRPC host:port (default: %(default)s)")
    server.add_argument("--http-url", default=DEFAULT_HTTP_URL, help="HTTP host:port (default: %(default)s)")
    server.add_argument("--protocol", choices=("grpc", "http"), default="grpc", help="default: %(default)s")
    server.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a response")

    parser = argparse.ArgumentParser(prog="python -m client", description="Talk to the LLM models on Triton.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", parents=[server], help="generate text, streamed to the terminal")
    generate.add_argument("prompt")
    generate.add_argument("--model", default="llm_continuous", help="default: %(default)s")
    generate.add_argument("--max-tokens", type=int)
    generate.add_argument("--min-tokens", type=int, help="no EOS or stop before this many tokens")
    generate.add_argument("--temperature", type=float, help="0 = greedy")
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true", default=None)
    generate.add_argument("--priority", type=int, help="Triton's level: 1 the highest (interactive), 3 batch; "
                          "default 2")
    generate.add_argument("--no-stream", dest="stream", action="store_false", help="one response with the whole text")
    generate.add_argument("--json", action="store_true", help="print the result with its timings as JSON")

    commands.add_parser("models", parents=[server], help="list served models, their batching and readiness")
    return parser.parse_args(argv)


def generate(client: LLMClient, args: argparse.Namespace) -> int:
    request = GenerationRequest(
        args.prompt,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        stream=args.stream,
        priority=args.priority,
    )
    generation = client.stream(args.model, request)
    try:
        for chunk in generation:
            if not args.json:
                print(chunk.text, end="", flush=True)
    except KeyboardInterrupt:
        generation.cancel()
        print("\n[cancelled]", file=sys.stderr)
        return 130
    result = generation.result()
    if args.json:
        print(json.dumps({key: getattr(result, key) for key in RESULT_KEYS}, indent=2, ensure_ascii=False))
        return 0

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    print()
    print(
        f"[{result.finish_reason}] {result.num_input_tokens} prompt + {result.num_output_tokens} generated tokens; "
        f"ttft {seconds(result.ttft_s)}, tpot {seconds(result.tpot_s)}, e2e {seconds(result.e2e_s)}",
        file=sys.stderr,
    )
    return 0


def models(client: LLMClient) -> int:
    rows = [("MODEL", "STATE", "BATCHING")]
    for info in client.models():
        rows.append((info.name, info.state or "-", info.batching or info.reason or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    for name, state, batching in rows:
        print(f"{name:<{widths[0]}}  {state:<{widths[1]}}  {batching}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with LLMClient(args.url, args.http_url, protocol=args.protocol, timeout=args.timeout) as client:
            return generate(client, args) if args.command == "generate" else models(client)
    except ClientError as exc:
        print(f"client: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
