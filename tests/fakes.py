"""Fakes for the unit tests of the server glue: a clock moved by hand, a port where no server answers, the response
side of ``triton_python_backend_utils`` (which exists only inside a Triton stub): errors, output tensors, responses;
and a Triton generation for the OpenAI frontend's answers."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from frontend.openai.triton_bridge import Piece


class FakeClock:
    """``time.monotonic`` that moves only when a test moves ``now``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def closed_port(address: str = "127.0.0.1") -> Iterator[int]:
    """A port on ``address`` that refuses every connection while the block runs: bound, never listening.

    NOTE: held, not merely found free: a port that ``free_ports`` returned may be taken meanwhile by a server that
    another test or process starts, and a client sent to it would find that server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind((address, 0))
        yield held.getsockname()[1]


class FakeError:
    """``pb_utils.TritonError``."""

    def __init__(self, message: str) -> None:
        self.message = message


class FakeTensor:
    """``pb_utils.Tensor``, an output tensor."""

    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array


class FakeResponse:
    """``pb_utils.InferenceResponse``: its output tensors by name, and its error."""

    def __init__(self, output_tensors: list = (), error: FakeError | None = None) -> None:
        self.tensors = {t.name: t.array for t in output_tensors}
        self.error = error


class FakeResponsePb:
    """What of ``pb_utils`` the responses layer uses (``backend/triton/stub/responses.py``'s ``pb``)."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    InferenceResponse, Tensor, TritonError = FakeResponse, FakeTensor, FakeError


class FakeGeneration:
    """The pieces after the first; ``finished`` once each of its ``n`` sequences has had its last (as
    frontend.openai.triton_bridge.TritonGeneration): the OpenAI frontend's answers without a server."""

    def __init__(self, first: Piece, pieces, n: int = 1) -> None:
        self.pieces, self.n = list(pieces), n
        self.num_ended = bool(first.finish_reason)

    @property
    def finished(self) -> bool:
        return self.num_ended >= self.n

    async def __anext__(self) -> Piece:
        if not self.pieces:
            raise StopAsyncIteration
        piece = self.pieces.pop(0)
        self.num_ended += bool(piece.finish_reason)
        return piece

    def __aiter__(self):
        return self

    async def aclose(self) -> None:
        pass
