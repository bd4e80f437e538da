"""Test infrastructure: free ports, real tritonserver processes started through the launcher, tiny models.

Every server started here is stopped: by the fixture that asked for it, by the session factory at the end, and
by an ``atexit`` hook as a last resort (the launcher also makes the server die with the test process).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Iterable, Mapping

from backend.triton.serve import PortInUse, TritonServer

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
LOCALHOST = "127.0.0.1"
# Tests never wait 30 s (tritonserver's default) for in-flight work at shutdown.
DEFAULT_SERVER_ARGS = ("--exit-timeout-secs", "5")

_servers: list[TritonServer] = []


def free_ports(count: int = 1) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now (all held open together, so never duplicates)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOCALHOST, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


class ServerFactory:
    """Starts ready tritonservers on free 127.0.0.1 ports with their logs in ``log_dir``; stops them all at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.servers: list[TritonServer] = []

    def start(
        self,
        model_repository: str | os.PathLike,
        *,
        model: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Iterable[str] = (),
        ready_timeout: float = 300.0,
    ) -> TritonServer:
        """Start a server through the launcher's API and wait until ready; raises ServerError with its errors."""
        for attempt in range(3):
            http_port, grpc_port, metrics_port = free_ports(3)
            server = TritonServer(
                model_repository,
                http_port=http_port,
                grpc_port=grpc_port,
                metrics_port=metrics_port,
                address=LOCALHOST,
                model=model,
                extra_args=[*DEFAULT_SERVER_ARGS, *extra_args],
                env=env,
                log_path=self.log_dir / f"{Path(model_repository).name}-{http_port}.log",
            )
            try:
                server.start()
            except PortInUse:  # another process took a port between choosing and binding it
                if attempt == 2:
                    raise
                continue
            break
        self.servers.append(server)
        _servers.append(server)
        try:
            server.wait_ready(ready_timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()


def servers_alive_since(t0: float) -> list[TritonServer]:
    """Servers that were running at some point after ``t0`` (``time.monotonic()``): the ones a test may have used."""
    return [s for s in _servers if s.started_at is not None and (s.stopped_at is None or s.stopped_at >= t0)]


def log_sections(t0: float, num_lines: int = 60) -> list[tuple[str, str]]:
    """Report sections with the log tail of every server a test may have used."""
    return [(f"tritonserver log tail ({server.log_path})", server.output_tail(num_lines)) for server in servers_alive_since(t0)]


@atexit.register
def _stop_every_server() -> None:
    for server in _servers:
        server.stop(timeout=10)


def make_tiny_llama(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised 2-layer Llama with SmolLM2's tokenizer, saved as a float32 HF folder in ``out_dir``.

    Same seed, same weights. Shaped for fast tests: hidden 64, 4 query heads, 2 KV heads (GQA), tied embeddings.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    reference = json.loads((tokenizer_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=reference["vocab_size"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=reference.get("bos_token_id"),
        eos_token_id=reference.get("eos_token_id"),
        pad_token_id=reference.get("pad_token_id"),
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    shutil.copy2(tokenizer_dir / "generation_config.json", out_dir / "generation_config.json")
    return out_dir

