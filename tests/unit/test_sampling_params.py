"""SamplingParams' ranges come from one table (backend/contract/sampling_ranges.py), which the OpenAI frontend's request
models state too: a value one accepts for its range, the other accepts; a refusal names the setting and its range.
EngineConfig.from_dict turns config.pbtxt's text into each setting's type."""

from __future__ import annotations

import pytest

from backend.contract.errors import InvalidRequest
from backend.contract.sampling_ranges import SAMPLING_RANGES, Range
from backend.engine.config import EngineConfig
from backend.engine.sampling_params import SamplingParams
from frontend.openai.protocol import ChatCompletionRequest, CompletionRequest

# Each setting just inside and just outside its range (logit_bias: one token's bias).
EDGES = {
    "max_tokens": ([1, 10**6], [0, -1]),
    "min_tokens": ([0], [-1]),
    "temperature": ([0.0, 7.5], [-0.1, float("inf")]),
    "top_p": ([1e-6, 1.0], [0.0, 1.01]),
    "top_k": ([-1, 0, 50], [-2]),
    "min_p": ([0.0, 1.0], [-0.01, 1.5, float("nan")]),
    "presence_penalty": ([-2.0, 2.0], [-2.01, 2.5]),
    "frequency_penalty": ([-2, 2], [-3, 3]),
    "repetition_penalty": ([1e-3, 5.0], [0.0, -1.0]),
    "seed": ([-(2**63), 2**64 - 1], [-(2**63) - 1, 2**64]),
    "n": ([1, 16], [0, 17]),
    "logprobs": ([0, 20], [-1, 21]),
    "prompt_logprobs": ([0, 20], [-1, 21]),
}


@pytest.mark.parametrize("name", sorted(EDGES))
def test_each_setting_takes_its_range_and_a_refusal_names_it(name):
    inside, outside = EDGES[name]
    for value in inside:
        SamplingParams(**{name: value})
        assert value in SAMPLING_RANGES[name] or value != value
    for value in outside:
        with pytest.raises(InvalidRequest) as refused:
            SamplingParams(**{name: value})
        assert refused.value.param == name
        assert f"{name} must {SAMPLING_RANGES[name].requirement}; got " in str(refused.value)
        assert value not in SAMPLING_RANGES[name]


def test_every_range_is_tested_and_logit_bias_reads_its_own():
    assert set(SAMPLING_RANGES) == {*EDGES, "logit_bias"}
    SamplingParams(logit_bias={"3": 100, 4: -100.0})
    with pytest.raises(InvalidRequest, match=r"logit_bias values must be in \[-100, 100\]; got 100.5"):
        SamplingParams(logit_bias={3: 100.5})


def test_a_bool_is_not_a_number_and_numbers_may_be_strings():
    for name in ("n", "max_tokens", "top_k", "temperature", "logprobs"):
        with pytest.raises(InvalidRequest, match=f"{name} must be"):
            SamplingParams(**{name: True})
    params = SamplingParams.from_dict({"max_tokens": "9", "temperature": "0.5", "top_k": "-1", "n": "2",
                                       "ignore_eos": "true", "stop": "END", "stop_token_ids": None})
    assert (params.max_tokens, params.temperature, params.top_k, params.n) == (9, 0.5, 0, 2)
    assert params.ignore_eos is True and params.stop == ["END"] and params.stop_token_ids == []


def test_requirements_read_as_a_person_would_say_them():
    assert Range(lo=0, hi=1, lo_open=True).requirement == "be in (0, 1]"
    assert Range(lo=1, integer=True).requirement == "be a positive integer"
    assert Range(lo=1, hi=16, integer=True).requirement == "be an integer from 1 to 16"
    assert Range(lo=0, note="0 = greedy").requirement == "be a finite number >= 0 (0 = greedy)"
    assert Range(lo=0, hi=1, lo_open=True).bounds == {"gt": 0, "le": 1}


@pytest.mark.parametrize("model, field, setting", [
    (CompletionRequest, "max_tokens", "max_tokens"),
    (ChatCompletionRequest, "max_completion_tokens", "max_tokens"),
    *((ChatCompletionRequest, name, name) for name in ("temperature", "top_p", "top_k", "min_p", "min_tokens",
                                                       "presence_penalty", "frequency_penalty", "repetition_penalty",
                                                       "n")),
    (CompletionRequest, "logprobs", "logprobs"),
    (CompletionRequest, "prompt_logprobs", "prompt_logprobs"),
    (ChatCompletionRequest, "top_logprobs", "logprobs"),
])
def test_the_openai_requests_state_the_engines_ranges(model, field, setting):
    stated = {}
    for constraint in model.model_fields[field].metadata:
        stated.update({k: getattr(constraint, k) for k in ("ge", "gt", "le", "lt") if hasattr(constraint, k)})
    assert stated == SAMPLING_RANGES[setting].bounds


def test_engine_settings_arrive_as_text_and_become_their_types():
    config = EngineConfig.from_dict({"max_model_len": " 2048 ", "enable_chunked_prefill": "true",
                                     "enable_prefix_caching": "false", "gpu_memory_utilization": "0.8",
                                     "num_kv_blocks": "", "quantization": "", "batching": "run_to_completion",
                                     "seed": str(2**64 - 1)})
    assert (config.max_model_len, config.enable_chunked_prefill, config.enable_prefix_caching) == (2048, True, False)
    assert (config.gpu_memory_utilization, config.num_kv_blocks, config.quantization) == (0.8, None, None)
    assert config.batching == "run_to_completion" and config.seed == 2**64 - 1
    for values, message in (({"block_size": "16.5"}, "block_size must be an integer; got '16.5'"),
                            ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching must be true or false"),
                            ({"gpu_memory_utilization": "most"}, "gpu_memory_utilization must be a number"),
                            ({"batching": "static"}, "batching must be one of")):
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_dict(values)
