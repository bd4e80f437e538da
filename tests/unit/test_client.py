"""The client library (client/) without a server: inputs for every served model's config, timings, the server-down
messages.

tests/server/test_client.py runs the client and its CLI against a stand-in model and the real models.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from client import (
    Chunk,
    GenerationRequest,
    GenerationResult,
    LLMClient,
    ServerUnavailable,
    build_inputs,
    describe_batching,
)
from tests.fakes import closed_port
from tests.server_harness import REPO_ROOT

BOTH_PROTOCOLS = pytest.mark.parametrize("protocol", ["grpc", "http"])


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "client", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("max_batch_size, batch_dims", [(0, ()), (8, (1,))])
def test_build_inputs_shapes_and_types(max_batch_size, batch_dims):
    request = GenerationRequest(
        "hi", max_tokens=4, temperature=0.0, seed=7, stop=["a", "bc"], ignore_eos=True, sampling_parameters={"top_k": 2}
    )
    inputs = {tensor.name(): tensor for tensor in build_inputs(request, max_batch_size)}
    assert sorted(inputs) == ["ignore_eos", "max_tokens", "sampling_parameters", "seed", "stop", "stream",
                              "temperature", "text_input"]
    expected = {
        "text_input": ("BYTES", [1]),
        "max_tokens": ("INT32", [1]),
        "temperature": ("FP32", [1]),
        "seed": ("UINT64", [1]),
        "stop": ("BYTES", [2]),
        "ignore_eos": ("BOOL", [1]),
        "stream": ("BOOL", [1]),
        "sampling_parameters": ("BYTES", [1]),
    }
    for name, (datatype, shape) in expected.items():
        assert inputs[name].datatype() == datatype, name
        assert inputs[name].shape() == [*batch_dims, *shape], name


def test_input_types_are_the_models_declared_ones():
    """The client's type table is what every model declares (backend/contract/io_schema.py; Triton refuses any other
    type), one entry per GenerationRequest field."""
    from backend.contract import io_schema
    from client.schema import INPUT_TYPES

    assert set(INPUT_TYPES) <= set(io_schema.INPUT_NAMES) and "text_input" in INPUT_TYPES
    for name, (datatype, dtype) in INPUT_TYPES.items():
        assert datatype == io_schema.BY_NAME[name].wire_type, name
        assert np.dtype(dtype).kind == {"BYTES": "O", "BOOL": "b", "FP32": "f", "INT32": "i", "UINT32": "u",
                                        "UINT64": "u"}[datatype], name


def test_request_values_leave_unset_inputs_out():
    assert GenerationRequest("x").input_values() == {"text_input": ["x"], "stream": [True]}
    values = GenerationRequest("x", stop="END", stream=False, sampling_parameters={"max_tokens": "3"}).input_values()
    assert values["stop"] == ["END"] and values["stream"] == [False]
    assert json.loads(values["sampling_parameters"][0]) == {"max_tokens": "3"}
    with pytest.raises(ValueError, match="text_input must be a str"):
        GenerationRequest(b"x")


def test_result_timings_from_chunks():
    def chunk(time_s, ids, text="t", finish=None, count=None):
        return Chunk(text, tuple(ids), finish, 3, count, time_s)

    result = GenerationResult.from_chunks(
        [chunk(0.5, [1], "a", count=1), chunk(0.75, [2], " b", count=2), chunk(1.25, [3, 4], " cd", "length", 4)],
        e2e_s=1.5,
    )
    assert result.text == "a b cd" and result.output_ids == [1, 2, 3, 4]
    assert (result.finish_reason, result.num_input_tokens, result.num_output_tokens) == ("length", 3, 4)
    assert result.ttft_s == 0.5 and result.itl_s == [0.25, 0.5] and result.e2e_s == 1.5
    assert result.tpot_s == pytest.approx((1.25 - 0.5) / 3)  # three tokens came after the first response
    # An empty final response carries no token: it changes neither the first token time nor the gaps.
    only = GenerationResult.from_chunks([chunk(0.2, [9], count=1), chunk(0.3, [], "", "stop")], e2e_s=0.3)
    assert (only.ttft_s, only.tpot_s, only.itl_s, only.finish_reason) == (0.2, None, [], "stop")


def test_describe_batching_tells_the_modes_apart():
    dynamic = {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_microseconds": "2000"}}  # gRPC JSON: str
    continuous = {
        "model_transaction_policy": {"decoupled": True},
        "parameters": {"batching": {"string_value": "continuous"}},
    }
    assert describe_batching(dynamic) == "dynamic batcher (max_batch_size 8, max_queue_delay 2000 µs)"
    assert describe_batching(continuous) == "decoupled, engine-side continuous batching"
    iterative = {
        "max_batch_size": 8, "model_transaction_policy": {"decoupled": True},
        "sequence_batching": {"iterative_sequence": True}, "parameters": {"batching": {"string_value": "iterative"}},
    }
    assert describe_batching(iterative) == "decoupled, Triton's iterative sequence batcher (max_batch_size 8)"
    assert describe_batching({}) == "no batching (max_batch_size 0)"


@BOTH_PROTOCOLS
@pytest.mark.timeout(30)
def test_server_down_message(protocol):
    with closed_port() as port:
        client = LLMClient(f"127.0.0.1:{port}", f"127.0.0.1:{port}", protocol=protocol)
        down = rf"no Triton server at 127\.0\.0\.1:{port} — start one with `make serve`"
        with pytest.raises(ServerUnavailable, match=down):
            client.generate("llm_continuous", GenerationRequest("hi"))
        with pytest.raises(ServerUnavailable):
            client.models()


@pytest.mark.timeout(60)
def test_cli_server_down_exits_with_one_line():
    with closed_port() as port:
        done = run_cli("generate", "--url", f"127.0.0.1:{port}", "hello")
    assert done.returncode == 1
    assert done.stderr.strip() == f"client: error: no Triton server at 127.0.0.1:{port} — start one with `make serve`"
