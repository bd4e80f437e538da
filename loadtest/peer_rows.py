"""vLLM as rows of ``make compare`` (``--peer vllm``): its OpenAI server, loaded by the same Locust workload at the
same load points as the Triton models, which run over their OpenAI frontend in that mode.

A row per seat count of ``--peer-seats`` (``default,8``: vLLM's own ``max_num_seqs``, and 8, Triton's batchers'
seats), each its own vLLM server (``loadtest/vllm_peer/server.py``) serving the model folder under the row's name, so
the Locust users send ``model`` = the row, as they send a Triton model's name. Every server is started before the
first load point and stopped after the last; the rows take turns with the Triton models at each load point, so only
one server is under load at a time while the others sit idle (the report states what the idle ones used).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from loadtest.runner import Target
from loadtest.vllm_peer.server import SERVED_MODEL_NAME, VENV, VllmServer, VllmSettings, complete

VLLM = SERVED_MODEL_NAME
PEERS = (VLLM,)
DEFAULT_SEATS = "default,8"


@dataclass(frozen=True)
class PeerRow:
    """vLLM at ``max_num_seqs`` seats (None: its default), a row named ``vllm`` or ``vllm_<N>seats``."""

    max_num_seqs: int | None = None

    @property
    def name(self) -> str:
        return VLLM if self.max_num_seqs is None else f"{VLLM}_{self.max_num_seqs}seats"

    def settings(self, model: Path, venv: Path) -> VllmSettings:
        """How its server serves: ``model`` under the row's name, at its seats, from ``venv``."""
        return VllmSettings(model=Path(model).resolve(), served_model_name=self.name, max_num_seqs=self.max_num_seqs,
                            venv=Path(venv).resolve())


def seat_counts(text: str) -> list[int | None]:
    """``default,8`` -> [None, 8] (None: vLLM's own default), each count once."""
    try:
        seats = [None if part.strip() == "default" else int(part) for part in text.split(",")]
    except ValueError:
        seats = []
    if not seats or any(s is not None and s < 1 for s in seats) or len(set(seats)) < len(seats):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated seat counts, each once (whole numbers, or "
                                         "default)")
    return seats


def peer_rows(seats: list[int | None]) -> list[PeerRow]:
    return [PeerRow(n) for n in seats]


def missing_venv(venv: Path = VENV) -> str | None:
    """Why vLLM cannot be started from ``venv`` (None: it can), naming the target that builds it."""
    python = Path(venv) / "bin" / "python"
    if python.exists():
        return None
    return (f"--peer vllm: {python} not found: `make vllm-venv` builds vLLM's environment (`make compare "
            "ARGS=\"--peer vllm\"` builds it first)")


@contextlib.contextmanager
def serve(row: PeerRow, model: Path, venv: Path, log_path: Path, metrics_url: str = "",
          say=print) -> Iterator[tuple[Target, dict]]:
    """vLLM serving ``row``, started and ready: a :class:`Target` whose OpenAI URL is vLLM's (``metrics_url``:
    Triton's, so each run's samples show whether a Triton model stepped meanwhile), and its settings as a report
    states them (``VllmServer.record``); stopped on exit."""
    server = VllmServer(row.settings(model, venv), log_path=log_path)
    say(f"starting vLLM for {row.name} ({server.settings.seats} seats; log: {log_path}) ...")
    with server:
        say(f"vLLM ready for {row.name}: {server.url} ({server.ready_s:.0f} s)")
        target = Target(server.url, "", metrics_url, server=server, model_folder=str(server.settings.model),
                        openai_url=server.url)
        yield target, server.record()


def warm_up(target: Target, row: str, concurrency: int = 8, max_tokens: int = 8, timeout: float = 120.0) -> float:
    """Two rounds of ``concurrency`` short completions through vLLM's OpenAI API, as ``runner.warm_up`` warms a
    Triton model; return seconds taken."""
    t0 = time.perf_counter()

    def one(i: int) -> None:
        complete(target.openai_url, row, f"warm up request number {i}", max_tokens, timeout)

    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(2):
            list(pool.map(one, range(concurrency)))
    return time.perf_counter() - t0
