"""The models' shared base without a server: the config checks every model makes, and how one new request is taken.

``backend/triton/stub/served_model.py`` imports ``triton_python_backend_utils``, which exists only inside a Triton
stub: a fake module stands in for it. Whatever happens to a new request (refused, not valid, refused by the driver,
taken), it gets exactly one final response or is open for the driver, never both and never neither.
"""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest

from backend.contract import errors
from backend.contract.errors import ErrorKind
from backend.engine.batching import EngineOverloaded, engine_failed
from backend.engine.config import EngineConfig
from backend.triton.stub.model_config import check_batcher, sequence_idle_seconds
from backend.triton.stub.parsing import RequestLimits
from backend.triton.stub.responses import OpenRequests
from tests.fakes import FakeError, FakeResponse

ITERATIVE_CONFIG = {"max_batch_size": 8, "sequence_batching": {"iterative_sequence": True,
                                                               "oldest": {"max_candidate_sequences": 8}}}


def test_each_batching_checks_what_it_needs_of_tritons_batcher_with_a_value_error():
    check_batcher("m", {"max_batch_size": 8}, EngineConfig(batching="run_to_completion", max_num_seqs=8))
    with pytest.raises(ValueError, match=r"m: max_num_seqs \(4\) must be >= max_batch_size \(8\) so a whole batch"):
        check_batcher("m", {"max_batch_size": 8}, EngineConfig(batching="run_to_completion", max_num_seqs=4))
    check_batcher("m", ITERATIVE_CONFIG, EngineConfig(batching="iterative", max_num_seqs=8))
    with pytest.raises(ValueError, match=r"m needs sequence_batching \{ iterative_sequence: true \}"):
        check_batcher("m", {"max_batch_size": 8}, EngineConfig(batching="iterative", max_num_seqs=8))
    with pytest.raises(ValueError, match=r"oldest \{ max_candidate_sequences \}"):
        check_batcher("m", ITERATIVE_CONFIG, EngineConfig(batching="iterative", max_num_seqs=4))
    # Under the priority policy the candidates beyond the seats wait in the engine's queue, by priority.
    check_batcher("m", ITERATIVE_CONFIG,
                  EngineConfig(batching="iterative", max_num_seqs=2, scheduling_policy="priority"))
    check_batcher("m", {"max_batch_size": 0}, EngineConfig(batching="continuous", max_num_seqs=4))
    levels = {"max_batch_size": 8, "dynamic_batching": {"priority_levels": "3", "default_priority_level": "2"}}
    check_batcher("m", levels, EngineConfig(batching="run_to_completion", max_num_seqs=8))
    levels["dynamic_batching"]["priority_levels"] = "5"
    with pytest.raises(ValueError, match="the priority input reads 3 levels with 2 the default"):
        check_batcher("m", levels, EngineConfig(batching="run_to_completion", max_num_seqs=8))
    assert sequence_idle_seconds(ITERATIVE_CONFIG) == 5.0
    assert sequence_idle_seconds({"sequence_batching": {"max_sequence_idle_microseconds": "250000"}}) == 0.25


# ---- admit(), with fakes for the stub's objects ----------------------------------------------------------------


class FakeTensor:
    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def shape(self) -> list[int]:
        return list(self.array.shape)

    def as_numpy(self) -> np.ndarray:
        return self.array


class FakeSender:
    def __init__(self) -> None:
        self.finals: list[FakeResponse] = []

    def send(self, response: FakeResponse, flags: int = 0) -> None:
        assert flags == 1, "only final responses are sent here"
        self.finals.append(response)


class FakeRequest:
    def __init__(self, **inputs: np.ndarray) -> None:
        self.inputs = {name: FakeTensor(array) for name, array in inputs.items()}
        self.sender = FakeSender()

    def get_response_sender(self) -> FakeSender:
        return self.sender

    def parameters(self) -> str:
        return "{}"

    def request_id(self) -> str:
        return ""


def fake_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.InferenceResponse, pb.TritonError = FakeResponse, FakeError
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    return pb


class FakeNotice:
    def __init__(self) -> None:
        self.set = False

    def is_set(self) -> bool:
        return self.set


@pytest.fixture
def model(monkeypatch):
    """A served model as ``initialize()`` leaves it, without an engine (the driver is the test's ``hand_over``)."""
    pb = fake_pb_utils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    served_model = importlib.reload(importlib.import_module("backend.triton.stub.served_model"))

    class Model(served_model.ServedModel, batching="continuous"):
        pass

    model = Model()
    model.name, model.failure, model.faults = "m", None, None
    model.shutdown, model.limits = FakeNotice(), RequestLimits(max_model_len=64)
    model.open = OpenRequests(pb, metrics=None, batched=False)
    yield model
    sys.modules.pop("backend.triton.stub.served_model", None)  # the fake must not outlive this test


def prompt(value: bytes = b"Hello", **inputs: np.ndarray) -> FakeRequest:
    return FakeRequest(text_input=np.array([value], dtype=np.object_), **inputs)


def test_a_valid_request_is_opened_and_handed_to_the_driver(model):
    handed = []
    request = prompt(max_tokens=np.array([3], dtype=np.int32), priority=np.array([1], dtype=np.uint32))
    request_id = model.admit(request, 12.5, lambda *args: handed.append(args))
    ((rid, text, params, arrival, priority),) = handed
    assert (rid, text, params.max_tokens, arrival, priority) == (request_id, "Hello", 3, 12.5, 1)
    assert len(model.open) == 1 and request.sender.finals == []  # the driver answers it


@pytest.mark.parametrize(
    "why, incoming, kind",
    [
        ("not valid", prompt(b"\xff"), ErrorKind.INVALID_REQUEST),
        ("not valid", prompt(max_tokens=np.array([64], dtype=np.int32)), ErrorKind.CONTEXT_LENGTH_EXCEEDED),
        ("engine failed", prompt(), ErrorKind.ENGINE_FAILED),
        ("shutting down", prompt(), ErrorKind.SHUTTING_DOWN),
        ("driver refused", prompt(), ErrorKind.OVERLOADED),
        ("driver refused the values", prompt(), ErrorKind.INVALID_REQUEST),
    ],
)
def test_a_request_that_is_not_taken_gets_one_final_error_and_stays_closed(model, why, incoming, kind):
    handed = []

    def hand_over(*args):
        handed.append(args)
        if why == "driver refused":
            raise EngineOverloaded(errors.message(ErrorKind.OVERLOADED, "256 requests are already waiting"))
        if why == "driver refused the values":
            raise ValueError("a check without a kind of its own")

    model.failure = engine_failed(RuntimeError()) if why == "engine failed" else None
    model.shutdown.set = why == "shutting down"
    assert model.admit(incoming, 0.0, hand_over) is None
    (response,) = incoming.sender.finals
    assert errors.parse(response.error.message).kind is kind, response.error.message
    assert len(model.open) == 0 and (handed == []) == (not why.startswith("driver refused"))
