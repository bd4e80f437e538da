"""Fakes for the unit tests of the server glue: a clock moved by hand, and the response side of
``triton_python_backend_utils`` (which exists only inside a Triton stub): errors, output tensors, responses."""

from __future__ import annotations

import numpy as np


class FakeClock:
    """``time.monotonic`` that moves only when a test moves ``now``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


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
