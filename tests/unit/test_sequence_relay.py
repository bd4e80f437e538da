"""SequenceRelay's pass-on loop without a server (fakes stand in for ``triton_python_backend_utils``): every response
of the copy reaches the client, and a copy that fails or whose client cancels ends the client's request with one
final error while the copy runs to its end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from backend.triton.stub.sequence_relay import CANCELLED, SequenceRelay

FINAL = 1


class Error:
    def __init__(self, message: str) -> None:
        self.message = message


class Response:
    def __init__(self, outputs=None, error: Error | None = None) -> None:
        self.outputs, self.error_value = outputs, error

    def has_error(self) -> bool:
        return self.error_value is not None

    def error(self) -> Error:
        return self.error_value

    def output_tensors(self):
        return self.outputs


class Responses:
    """The copy's responses (BLS ``exec(decoupled=True)``), counting what was read and whether it was cancelled."""

    def __init__(self, responses: list[Response]) -> None:
        self._responses, self.read, self.cancelled = iter(responses), 0, False

    def __iter__(self):
        return self

    def __next__(self) -> Response:
        response = next(self._responses)
        self.read += 1
        return response

    def cancel(self) -> None:
        self.cancelled = True


class Sender:
    def __init__(self, cancelled_after: int | None = None) -> None:
        self.sent, self._cancelled_after = [], cancelled_after

    def is_cancelled(self) -> bool:
        return self._cancelled_after is not None and len(self.sent) >= self._cancelled_after

    def send(self, response=None, flags: int = 0) -> None:
        self.sent.append((response, flags))


def fake_pb() -> SimpleNamespace:
    return SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
        TritonError=Error,
        InferenceResponse=lambda output_tensors=None, error=None: SimpleNamespace(outputs=output_tensors, error=error),
    )


def pass_on(responses: Responses, sender: Sender) -> None:
    copy = SimpleNamespace(exec=lambda decoupled: responses)
    SequenceRelay(fake_pb(), "llm_iterative")._pass_on(copy, sender)


def test_every_response_reaches_the_client_then_one_final():
    responses, sender = Responses([Response(["a"]), Response(["b"]), Response([])]), Sender()
    pass_on(responses, sender)
    assert [(r.outputs if r else None, f) for r, f in sender.sent] == [(["a"], 0), (["b"], 0), (None, FINAL)]


@pytest.mark.parametrize("case", ["copy fails", "client cancels"])
def test_the_client_gets_one_final_error_and_the_copy_runs_to_its_end(case):
    if case == "copy fails":
        responses, sender = Responses([Response(["a"]), Response(error=Error("boom")), Response(["c"])]), Sender()
    else:
        responses, sender = Responses([Response(["a"]), Response(["b"]), Response(["c"])]), Sender(cancelled_after=1)
    pass_on(responses, sender)
    (first, flags), (last, last_flags) = sender.sent
    assert first.outputs == ["a"] and flags == 0
    assert last_flags == FINAL and last.error is not None
    assert last.error.message == ("boom" if case == "copy fails" else CANCELLED)  # the copy's own error as it is
    assert responses.read == 3, "the copy's remaining responses are read to its end"
    assert responses.cancelled == (case == "client cancels")
