"""A request's priority from end to end, without a server: Triton's level (backend/contract/priority.py), the models'
``priority`` input, the OpenAI field and what the client sends."""

import numpy as np
import pytest

from backend.contract.errors import InvalidRequest
from backend.contract.priority import (
    BATCH,
    DEFAULT_PRIORITY_LEVEL,
    INTERACTIVE,
    PRIORITY_LEVELS,
    level_of_openai,
    openai_priority,
    priority_level,
)
from backend.triton.stub.parsing import RequestLimits, parse_request
from client.schema import GenerationRequest
from frontend.openai.protocol import CompletionRequest

LIMITS = RequestLimits(max_model_len=64)


def parse(**inputs):
    return parse_request({"text_input": np.array([b"Hello"], dtype=np.object_), **inputs}, LIMITS)


def test_levels_read_as_triton_reads_them():
    assert (INTERACTIVE, DEFAULT_PRIORITY_LEVEL, BATCH) == (1, 2, 3) == (1, 2, PRIORITY_LEVELS)
    assert [priority_level(level) for level in (0, 1, 2, 3, 4, 99)] == [2, 1, 2, 3, 2, 2]


def test_the_openai_priority_maps_onto_levels_in_the_same_direction():
    assert [level_of_openai(p) for p in (-100, -1, 0, 1, 100)] == [1, 1, 2, 3, 3]
    assert [openai_priority(level) for level in (0, 1, 2, 3)] == [0, -1, 0, 1]
    assert all(level_of_openai(openai_priority(level)) == priority_level(level) for level in range(5))
    assert CompletionRequest(model="m", prompt="x").generation_request("x").priority == DEFAULT_PRIORITY_LEVEL
    assert CompletionRequest(model="m", prompt="x", priority=-5).generation_request("x").priority == INTERACTIVE


def test_the_priority_input_is_parsed_as_a_level():
    assert parse().priority == DEFAULT_PRIORITY_LEVEL
    assert parse(priority=np.array([1], dtype=np.uint32)).priority == 1
    assert parse(priority=np.array([[3]], dtype=np.uint32)).priority == 3  # a model with a batch dimension
    assert parse(priority=np.array([0], dtype=np.uint32)).priority == DEFAULT_PRIORITY_LEVEL
    assert parse(priority=np.array([7], dtype=np.uint32)).priority == DEFAULT_PRIORITY_LEVEL
    with pytest.raises(InvalidRequest, match="priority must be an integer"):
        parse(priority=np.array([1.5], dtype=np.float32))


def test_the_client_sends_the_priority_input_only_when_given():
    assert "priority" not in GenerationRequest("x").input_values()
    assert GenerationRequest("x", priority=1).input_values()["priority"] == [1]
