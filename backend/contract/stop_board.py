"""The stop board: how a client on the server's host ends a request early without cancelling its gRPC stream.

Triton 2.51's gRPC frontend can crash when a client cancels a stream (``ModelStreamInferHandler::Process``: the
stream is freed while its cancellation notice is still queued; docs/server.md, "A known crash in Triton 2.51";
triton_workarounds.GRPC_CANCEL_RACE). The
OpenAI frontend, which runs beside tritonserver, therefore never cancels: it posts the request's id (the ``id`` it
gave Triton) on the board and keeps reading. Every model reads the board before each engine step; a posted request
is aborted like a cancelled one (its KV blocks freed at once) but answered with its own final response
(``finish_reason`` "abort"), so its stream ends the normal way. The poster withdraws the post once the stream ended.

The board is a directory (on tmpfs where there is one), one empty file per posted request id. Its place follows from
the server's gRPC port (``for_port``), so a frontend started by hand beside ``make serve`` finds it as the launcher's
does, and a restarted server keeps its frontend's board; ``$LLM_STOP_BOARD`` names another. The launcher clears it
when it starts tritonserver and names it to the models in ``$LLM_STOP_BOARD``. Reading it is one ``listdir`` a step.

    board = StopBoard.find("127.0.0.1:8001")   # the frontend; None when there is none: then cancel the stream
    board.post("openai-1f0c...")       # the frontend, when its client went away
    board.posted()                     # the models, before each step: {"openai-1f0c..."}
    board.withdraw("openai-1f0c...")   # the frontend, once the request's final response came

NOTE: standard library only (``backend/contract/__init__.py``).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from backend.contract.settings import STOP_BOARD_ENV_VAR

_THIS_HOST = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}
# A request id that can name a file: what the frontend gives its requests, and what a client's own ids usually are.
_POSTABLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class StopBoard:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"StopBoard({str(self.path)!r})"

    @classmethod
    def for_port(cls, grpc_port: int, environ: Mapping[str, str] | None = None) -> "StopBoard":
        """The board of the server on this host whose gRPC port is ``grpc_port`` (``$LLM_STOP_BOARD`` if set): on
        /dev/shm where it can be written (no disk write per stop)."""
        path = (os.environ if environ is None else environ).get(STOP_BOARD_ENV_VAR)
        if path:
            return cls(path)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        return cls(Path(shm) / f"llm-stop-board-{int(grpc_port)}")

    @classmethod
    def find(cls, grpc_url: str, environ: Mapping[str, str] | None = None) -> "StopBoard | None":
        """The board of the server at ``grpc_url`` if this process can see it: a server on this host, started by
        the launcher. None otherwise (a server elsewhere, or in another container): then streams are cancelled."""
        host, _, port = grpc_url.rpartition(":")
        if not port.isdigit() or host.strip("[]") not in _THIS_HOST:
            return None
        board = cls.for_port(int(port), environ)
        return board if board.path.is_dir() else None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "StopBoard | None":
        """The board ``$LLM_STOP_BOARD`` names (the models': the launcher sets it), if it is a directory."""
        path = (os.environ if environ is None else environ).get(STOP_BOARD_ENV_VAR)
        return cls(path) if path and os.path.isdir(path) else None

    def clear(self) -> "StopBoard":
        """Make it empty (a new server's: posts for the requests of one that died mean nothing now)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    @staticmethod
    def can_post(request_id: str) -> bool:
        return bool(_POSTABLE.fullmatch(request_id))

    def post(self, request_id: str) -> bool:
        """Ask the model that holds ``request_id`` to end it; false if it cannot be posted (an id that is no file
        name, or a board gone with its server): then the caller cancels."""
        if not self.can_post(request_id):
            return False
        try:
            (self.path / request_id).touch()
        except OSError:
            return False
        return True

    def withdraw(self, request_id: str) -> None:
        if self.can_post(request_id):
            try:
                (self.path / request_id).unlink(missing_ok=True)
            except OSError:
                pass

    def posted(self) -> frozenset[str]:
        """The request ids posted now (empty if the board is gone)."""
        try:
            return frozenset(os.listdir(self.path))
        except OSError:
            return frozenset()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
