"""Test infrastructure: real tritonserver processes started through the launcher, their repositories, tiny models.

Every server started here is stopped: by the fixture that asked for it, by the session factory at the end, and
by an ``atexit`` hook as a last resort (the launcher also makes the server die with the test process).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Mapping

from backend.contract import errors
from backend.contract.errors import ErrorKind
from backend.contract.settings import DEFAULT_MODEL
from backend.triton.launcher.launch_options import LOOPBACK, copy_model_repository
from backend.triton.launcher.server import ServerError, TritonServer, start_on_free_ports

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_DIR = REPO_ROOT / DEFAULT_MODEL
LOCALHOST = LOOPBACK
# Tests never wait 30 s (tritonserver's default) for in-flight work at shutdown.
DEFAULT_SERVER_ARGS = ("--exit-timeout-secs", "5")
# Triton 2.51's Python backend aborts the whole server when a stub does not take a shared-memory lock within its
# timeout while the models load: seen once on a 2-core machine that a cancel storm and the suite shared. Not a
# defect of the models; a start that ends so is tried once more.
STARTUP_ABORT = "boost::interprocess::lock_exception"
COMPARED_MODELS = ("llm_dynamic", "llm_continuous")
# The tiny Llama in float32, a 256-token context and a small KV pool (256 blocks of 16 tokens).
TINY_SETTINGS = {"dtype": "float32", "max_model_len": "256", "num_kv_blocks": "256"}

_servers: list[TritonServer] = []


def docker_env_or_skip() -> dict:
    """The environment for docker commands against the engine that answers (docker/engine.sh); without one, the
    calling test or fixture is skipped, or fails on CI (where .ci/run provisions one)."""
    import pytest

    from loadtest.scale import docker_host

    host = docker_host()
    if host is None:
        reason = "no Docker engine answers (bash docker/engine.sh up provisions one; .ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; on CI it must")
        pytest.skip(reason)
    return {**os.environ, "DOCKER_HOST": host}


def error_kind(message: str | None) -> ErrorKind | None:
    """The kind of a model's (or Triton's full-queue) error message, by its code; None for no error or another."""
    parsed = None if message is None else errors.parse(message)
    return None if parsed is None else parsed.kind
_log_numbers = itertools.count()


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
        """Start a server through the launcher's API and wait until ready; raises ServerError with its errors.
        A start that tritonserver aborts in the Python backend's stub handshake (``STARTUP_ABORT``) is tried once
        more."""
        for attempt in (1, 2):
            try:
                return start_on_free_ports(
                    model_repository,
                    model=model,
                    extra_args=[*DEFAULT_SERVER_ARGS, *extra_args],
                    env=env,
                    log_path=self.log_dir / f"{Path(model_repository).name}-{next(_log_numbers)}.log",
                    ready_timeout=ready_timeout,
                    on_start=self._keep,  # before it is ready: a server that fails to start has a log to show
                )  # ready; a server that is not is stopped and ServerError raised
            except ServerError as exc:
                if attempt == 2 or STARTUP_ABORT not in str(exc):
                    raise
                print(f"tritonserver aborted its start ({STARTUP_ABORT}); starting it again", file=sys.stderr)
        raise AssertionError("unreachable")

    def _keep(self, server: TritonServer) -> None:
        self.servers.append(server)
        _servers.append(server)

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()


class ServerSlot:
    """A module's shared server, started again when it died: a crash fails the test it happened in, not every test
    after it. ``restart()`` is for a test that may try again after Triton 2.51's known gRPC-frontend crash
    (``known_crash()``; docs/server.md, "A known crash in Triton 2.51"), as the soak does."""

    def __init__(self, factory: ServerFactory, model_repository: Path, **start_kwargs) -> None:
        self.factory, self.model_repository, self.start_kwargs = factory, model_repository, start_kwargs
        self.server = factory.start(model_repository, **start_kwargs)

    def live(self) -> TritonServer:
        """The server, started again first if it is no longer running."""
        return self.server if self.server.is_running else self.restart()

    def restart(self) -> TritonServer:
        self.server.stop()
        self.server = self.factory.start(self.model_repository, **self.start_kwargs)
        return self.server

    def known_crash(self) -> str | None:
        """Where the server crashed, when it is down with the known gRPC-frontend crash; None otherwise."""
        from backend.triton.launcher import crash

        try:
            self.server.wait(timeout=5)  # a crashing server may still be writing its stack
        except subprocess.TimeoutExpired:
            return None
        return crash.known_frontend_crash(self.server.output_lines())


def make_repository(
    dst: Path,
    params: dict[str, str] | None = None,
    *,
    models: Iterable[str] = COMPARED_MODELS,
    max_batch_size: int | None = None,
    dynamic_queue_size: int | None = None,
) -> Path:
    """A copy of model_repository/'s ``models`` (by default the two compared ones) for the tiny Llama:
    ``TINY_SETTINGS``, then ``params``, set in their configs. ``max_batch_size`` and ``dynamic_queue_size`` change
    llm_dynamic's batch size and Triton's queue bound."""
    copy_model_repository(dst, models, {**TINY_SETTINGS, **(params or {})})
    path = dst / "llm_dynamic" / "config.pbtxt"
    if path.exists() and (max_batch_size is not None or dynamic_queue_size is not None):
        # NOTE: imported here: conftest imports this module, also in .venv310, which has no protobuf.
        from backend.triton.launcher import config_text

        with config_text.edit(path) as config:
            if max_batch_size is not None:
                config_text.set_max_batch_size(config, max_batch_size)
            if dynamic_queue_size is not None:
                config_text.dynamic_batching(config).default_queue_policy.max_queue_size = dynamic_queue_size
    return dst


def read_events(response, count: int, prefix: bytes = b"data:") -> None:
    """Read a server-sent event stream (a ``requests`` response) up to its ``count``-th line starting with ``prefix``,
    and stop there, the connection still open; fail if the stream ends first."""
    events = 0
    for line in response.iter_lines():
        events += line.startswith(prefix)
        if events == count:
            return
    raise AssertionError(f"the stream ended after {events} events")


def servers_alive_since(t0: float) -> list[TritonServer]:
    """Servers that were running at some point after ``t0`` (``time.monotonic()``): the ones a test may have used."""
    return [s for s in _servers if s.started_at is not None and (s.stopped_at is None or s.stopped_at >= t0)]


def log_sections(t0: float, num_lines: int = 60) -> list[tuple[str, str]]:
    """Report sections with the log tail of every server a test may have used."""
    return [(f"tritonserver log tail ({server.log_path})", server.output_tail(num_lines))
            for server in servers_alive_since(t0)]


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

