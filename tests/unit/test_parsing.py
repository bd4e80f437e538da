"""Request parsing without a server: a request's input tensors and parameters -> prompt, sampling settings, stream.

Inputs are numpy arrays shaped as Triton hands them over (``[1]`` for a model without a batch dimension, ``[1, 1]``
with one); ``read_inputs`` gets a fake ``pb`` that stands in for ``triton_python_backend_utils``. Every refusal must be
an ``InvalidRequest`` (a ``ValueError``) whose message a client can act on, its kind and the parameter to blame in
front: the model sends it as that request's error.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from backend.contract.errors import InvalidRequest
from backend.contract.sampling_ranges import MAX_STOP_STRINGS
from backend.engine.sampling_params import SamplingParams
from backend.triton.stub.parsing import (
    MAX_PARAMETERS_BYTES,
    MAX_PROMPT_BYTES_PER_TOKEN,
    RequestLimits,
    parse_request,
    read_inputs,
    read_parameters,
)

LIMITS = RequestLimits(max_model_len=64)


def text(*values: str | bytes, batched: bool = False) -> np.ndarray:
    array = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)
    return array.reshape(1, -1) if batched else array


def scalar(value, dtype) -> np.ndarray:
    return np.array([value], dtype=dtype)


def parse(parameters: str = "", **inputs: np.ndarray):
    return parse_request({"text_input": text("Hello"), **inputs}, LIMITS, parameters)


def test_a_prompt_alone_takes_the_engines_defaults():
    for batched in (False, True):
        parsed = parse_request({"text_input": text("Bonjour ✓", batched=batched)}, LIMITS)
        assert parsed.prompt == "Bonjour ✓"
        assert parsed.params == SamplingParams()  # one owner of every default (max_tokens among them)
        assert parsed.stream is False and parsed.omitted_outputs == frozenset()


def test_settings_come_from_inputs_then_request_parameters_then_sampling_parameters():
    parsed = parse(max_tokens=scalar(5, np.int32), temperature=scalar(0.5, np.float32), seed=scalar(7, np.uint64),
                   ignore_eos=scalar(True, np.bool_), stream=scalar(True, np.bool_))
    assert (parsed.params.max_tokens, parsed.params.temperature, parsed.params.seed) == (5, 0.5, 7)
    assert parsed.params.ignore_eos is True and parsed.stream is True
    layered = parse(json.dumps({"max_tokens": 7, "top_k": 3}), max_tokens=scalar(5, np.int32),
                    sampling_parameters=text(json.dumps({"max_tokens": "9"})))  # numbers as strings, as genai-perf
    assert (layered.params.max_tokens, layered.params.top_k) == (9, 3)


def test_stop_strings_aliases_and_optional_outputs():
    parsed = parse(stop=text("\n\n", "END"), min_length=scalar(2, np.int32),
                   return_finish_reason=scalar(False, np.bool_), return_num_input_tokens=scalar(True, np.bool_))
    assert parsed.params.stop == ["\n\n", "END"] and parsed.params.min_tokens == 2
    assert parsed.omitted_outputs == frozenset({"finish_reason"})
    with pytest.raises(ValueError, match="send either 'min_tokens' or 'min_length'"):
        parse(min_length=scalar(2, np.int32), min_tokens=scalar(2, np.int32))


def test_logprobs_are_asked_by_return_logprobs_or_by_sampling_parameters():
    assert parse().params.logprobs is None and "logprobs" not in parse().requested_outputs
    switched = parse(return_logprobs=scalar(True, np.bool_))
    assert switched.params.logprobs == 0 and "logprobs" in switched.requested_outputs
    top = parse(return_logprobs=scalar(True, np.bool_), sampling_parameters=text('{"logprobs": 5}'))
    assert top.params.logprobs == 5
    assert "logprobs" in parse(sampling_parameters=text('{"logprobs": "2"}')).requested_outputs
    assert parse(return_logprobs=scalar(False, np.bool_)).params.logprobs is None
    penalized = parse(sampling_parameters=text(json.dumps(
        {"presence_penalty": 0.5, "repetition_penalty": "1.2", "min_p": 0.1, "logit_bias": {"42": -100}})))
    assert penalized.params.logit_bias == {42: -100.0} and penalized.params.repetition_penalty == 1.2


@pytest.mark.parametrize(
    "inputs, parameters, code, message",
    [
        ({"text_input": None}, "", "invalid_request:text_input", "missing required input 'text_input'"),
        ({"text_input": text("a", "b")}, "", "invalid_request:text_input", "exactly one prompt per request; got 2"),
        ({"text_input": text("")}, "", "invalid_request:text_input", "text_input is empty"),
        ({"text_input": text(b"\xff\xfe")}, "", "invalid_request:text_input",
         r"text_input is not valid UTF-8 \(byte 0\)"),
        ({"text_input": text("x" * (MAX_PROMPT_BYTES_PER_TOKEN * 64 + 1))}, "", "context_length_exceeded:text_input",
         f"text_input is {MAX_PROMPT_BYTES_PER_TOKEN * 64 + 1} bytes; the limit is {MAX_PROMPT_BYTES_PER_TOKEN * 64}"),
        ({"max_tokens": scalar(64, np.int32)}, "", "context_length_exceeded:max_tokens",
         r"max_tokens is 64, beyond this model's max_model_len \(64\)"),
        ({"max_tokens": scalar(0, np.int32)}, "", "invalid_request:max_tokens",
         "max_tokens must be a positive integer; got 0"),
        ({"temperature": scalar(np.nan, np.float32)}, "", "invalid_request:temperature",
         "input 'temperature' must be a finite number"),
        ({"top_k": np.array([1, 2], dtype=np.int32)}, "", "invalid_request:top_k",
         "input 'top_k' must hold one value; got 2"),
        ({"stop": text(*["s"] * (MAX_STOP_STRINGS + 1))}, "", "invalid_request:stop",
         f"at most {MAX_STOP_STRINGS} stop strings"),
        ({"sampling_parameters": text("{not json")}, "", "invalid_request:sampling_parameters",
         "sampling_parameters is not valid JSON"),
        ({"sampling_parameters": text("[1]")}, "", "invalid_request:sampling_parameters",
         "sampling_parameters must be a JSON object"),
        ({"sampling_parameters": text('{"beam_width": 2}')}, "", "invalid_request:sampling_parameters",
         r"unknown key\(s\) in sampling_parameters: beam_width"),
        ({}, '{"model": "x"}', "invalid_request", r"unknown key\(s\) in the request parameters: model"),
        ({}, "x" * (MAX_PARAMETERS_BYTES + 1), "invalid_request",
         f"the request parameters is {MAX_PARAMETERS_BYTES + 1} characters"),
    ],
    ids=["no-prompt", "two-prompts", "empty", "not-utf8", "too-long", "max-tokens-too-big", "max-tokens-zero",
         "nan", "two-values", "too-many-stops", "bad-json", "not-object", "unknown-key", "unknown-parameter",
         "huge-parameters"],
)
def test_a_bad_request_is_refused_with_a_message_that_names_the_problem(inputs, parameters, code, message):
    """The message starts with the code of its kind and the parameter to blame (backend/contract/errors.py)."""
    request = {"text_input": text("Hello"), **inputs}
    if request["text_input"] is None:
        del request["text_input"]
    with pytest.raises(InvalidRequest, match=message) as refused:
        parse_request(request, LIMITS, parameters)
    assert str(refused.value).startswith(f"[{code}] ")


class FakeTensor:
    def __init__(self, array: np.ndarray) -> None:
        self.array, self.converted = array, False

    def shape(self) -> list[int]:
        return list(self.array.shape)

    def as_numpy(self) -> np.ndarray:
        self.converted = True
        return self.array


class FakeRequest:
    def __init__(self, parameters: str = "{}", **tensors: np.ndarray) -> None:
        self.tensors = {name: FakeTensor(array) for name, array in tensors.items()}
        self._parameters = parameters

    def parameters(self) -> str:
        return self._parameters


class FakePb:
    @staticmethod
    def get_input_tensor_by_name(request: FakeRequest, name: str) -> FakeTensor | None:
        return request.tensors.get(name)


def test_read_inputs_leaves_out_what_was_not_sent_and_counts_elements_before_converting():
    request = FakeRequest(text_input=text("Hello"), max_tokens=scalar(3, np.int32))
    inputs = read_inputs(FakePb, request)
    assert sorted(inputs) == ["max_tokens", "text_input"]
    assert parse_request(inputs, LIMITS, read_parameters(request)).params.max_tokens == 3
    huge = FakeRequest(text_input=text("Hello"), stop=text(*["s"] * 1000))
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS} stop strings are allowed; got 1000"):
        read_inputs(FakePb, huge)
    assert not huge.tensors["stop"].converted  # refused on its shape: no thousand Python objects
    with pytest.raises(ValueError, match="input 'seed' must hold one value per request; got 2"):
        read_inputs(FakePb, FakeRequest(text_input=text("Hello"), seed=np.array([1, 2], dtype=np.uint64)))
    assert read_parameters(FakeRequest("{}")) == "" and read_parameters(FakeRequest('{"top_k": 1}')) == '{"top_k": 1}'


def test_n_comes_as_an_input_or_in_sampling_parameters_and_best_of_is_refused():
    assert parse(n=scalar(3, np.int32)).params.n == 3
    assert parse(sampling_parameters=text(json.dumps({"n": 2}))).params.n == 2
    with pytest.raises(InvalidRequest, match="n must be"):
        parse(n=scalar(0, np.int32))
    with pytest.raises(InvalidRequest, match="best_of"):
        parse(sampling_parameters=text(json.dumps({"n": 2, "best_of": 4})))
