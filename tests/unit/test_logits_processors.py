"""Penalties, logit bias and min_p: the batched tensor path against a plain per-row reference written here, their
validation, and what they do to the sampler's picks."""

from __future__ import annotations

import math

import pytest
import torch

from backend.contract.errors import InvalidRequest
from backend.engine.logits_processors import LogitsAdjustments
from backend.engine.sampler import Sampler
from backend.engine.sampling_params import SamplingParams

VOCAB = 64


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, as vLLM's and OpenAI's definitions read, token by token."""
    x = logits.clone().float()
    for token, bias in params.logit_bias.items():
        x[token] += bias
    for token in range(VOCAB):
        count = output.count(token)
        if token in prompt or count:
            rp = params.repetition_penalty
            x[token] = x[token] / rp if x[token] > 0 else x[token] * rp
        x[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    if params.min_p > 0 and not params.greedy:
        probs = torch.softmax(x / params.temperature, dim=-1)
        x[probs < params.min_p * probs.max()] = -math.inf
    return x


CASES = [
    SamplingParams(),  # untouched beside the others
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7, temperature=0.0),
    SamplingParams(frequency_penalty=-0.5, presence_penalty=-1.0),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8, presence_penalty=0.2, frequency_penalty=0.1),
    SamplingParams(logit_bias={3: 100.0, 5: -100.0, 7: 2.5}),
    SamplingParams(min_p=0.1, temperature=0.7),
    SamplingParams(min_p=0.3, temperature=1.5, repetition_penalty=1.2, logit_bias={1: 4.0}),
    SamplingParams(min_p=0.5, temperature=0.0),  # greedy: min_p has nothing to do
]


def test_batched_adjustments_match_the_per_row_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), VOCAB, generator=gen) * 3
    histories = [torch.randint(0, VOCAB, (12,), generator=gen).tolist() for _ in CASES]
    prompt_lens = [4 + i % 5 for i in range(len(CASES))]
    adjusted = LogitsAdjustments.of(CASES, histories, prompt_lens, VOCAB).apply(logits.clone())
    for row, params in enumerate(CASES):
        history, n = histories[row], prompt_lens[row]
        expected = reference(logits[row], params, history[:n], history[n:])
        torch.testing.assert_close(adjusted[row], expected, msg=f"row {row}: {params}")


def test_nothing_is_built_when_no_row_asks():
    assert LogitsAdjustments.of([SamplingParams(), SamplingParams(temperature=0.0, min_p=0.5)], [[1], [2]],
                                [1, 1], VOCAB) is None


def test_sampler_honours_bias_and_penalties_greedy_and_sampled():
    logits = torch.zeros(2, VOCAB)
    logits[:, 9] = 5.0
    ids, history = ["a", "b"], [[1, 2], [1, 2, 9]]  # row b generated token 9 already
    biased = SamplingParams(temperature=0.0, logit_bias={9: -100, 11: 1.0})
    assert Sampler()(logits.clone(), ids, [biased, SamplingParams(temperature=0.0)], None, history, [2, 2]) == [11, 9]
    penalized = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0, logit_bias={4: 1.5})
    assert Sampler()(logits.clone(), ids, [SamplingParams(temperature=0.0), penalized], None, history, [2, 2]) == [9, 4]
    sampled = SamplingParams(temperature=1.0, min_p=0.5, seed=3)
    picks = {Sampler()(logits[:1].clone(), ["a"], [sampled], None, history[:1], [2])[0] for _ in range(20)}
    assert picks == {9}  # every other token is far below half of token 9's probability


@pytest.mark.parametrize("bad", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0}, {"repetition_penalty": "x"},
    {"min_p": 1.5}, {"logit_bias": {"5": 101}}, {"logit_bias": {"-1": 1}}, {"logit_bias": {"a": 1}},
    {"logit_bias": [1, 2]}, {"min_p": float("nan")},
])
def test_out_of_range_settings_are_refused_naming_them(bad):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams.from_dict(bad)
    assert err.value.param == next(iter(bad))


def test_settings_parse_as_sent_and_token_ids_are_checked_against_the_vocabulary():
    params = SamplingParams.from_dict({"logit_bias": {"7": -2}, "min_p": "0.05",
                                       "repetition_penalty": "1.1"})
    assert params.logit_bias == {7: -2.0} and params.min_p == 0.05 and params.repetition_penalty == 1.1
    params.check_token_ids(8)
    with pytest.raises(InvalidRequest, match="token id 7"):
        params.check_token_ids(7)
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(stop_token_ids=[99]).check_token_ids(50)
    assert err.value.param == "stop_token_ids"


def test_logprobs_come_from_the_distribution_drawn_from():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=gen) * 2
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(),
              SamplingParams(temperature=0.5, presence_penalty=1.0, logprobs=0, seed=1)]
    history = [[1, 2, 3], [1], [4, 5, 6, 7]]
    out = Sampler().sample(logits.clone(), ["a", "b", "c"], params, None, history, [1, 1, 2])
    assert out.logprobs[1] is None
    greedy = out.logprobs[0]
    expected = torch.log_softmax(logits[0], dim=-1)
    assert greedy.rank == 1 and greedy.logprob == pytest.approx(expected.max().item(), abs=1e-5)
    assert list(greedy.top_token_ids) == expected.topk(3).indices.tolist()
    assert greedy.top_logprobs == pytest.approx(expected.topk(3).values.tolist(), abs=1e-5)
    drawn = torch.log_softmax(reference(logits[2], params[2], [4, 5], [6, 7]) / 0.5, dim=-1)
    token = out.token_ids[2]
    assert out.logprobs[2].logprob == pytest.approx(drawn[token].item(), abs=1e-5)
    assert out.logprobs[2].rank == int((drawn > drawn[token]).sum()) + 1 and out.logprobs[2].top_token_ids == ()


def test_the_engine_returns_each_tokens_logprobs_and_refuses_unknown_token_ids(tiny_llama_dir):
    from backend.engine.config import EngineConfig
    from backend.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_threads=1, max_model_len=128,
                                    num_kv_blocks=32))
    engine.add_request("lp", "Hello there", SamplingParams(max_tokens=3, temperature=0.0, logprobs=2,
                                                           repetition_penalty=1.3))
    engine.add_request("plain", "Hello there", SamplingParams(max_tokens=3, temperature=0.0))
    outputs = [out for _ in range(3) for out in engine.step()]
    for out in outputs:
        if out.request_id == "plain":
            assert out.logprobs is None
            continue
        (ranked,) = out.logprobs
        token_id, first = next(iter(ranked.items()))
        assert token_id == out.new_token_ids[0] and first.rank == 1  # greedy: the likeliest
        assert first.decoded_token == engine.tokenizer.hf.decode([token_id])
        assert len(ranked) == 2 and all(lp.logprob <= 0 for lp in ranked.values())
    vocab = engine.config.model_shape.vocab_size
    with pytest.raises(InvalidRequest, match="logit_bias names token id"):
        engine.add_request("bad", "Hi", SamplingParams(logit_bias={vocab: 1.0}))


def test_min_p_is_relative_to_the_best_token_that_may_be_picked():
    logits = torch.full((1, VOCAB), -20.0)
    logits[0, :3] = torch.tensor([10.0, 5.0, 4.5])  # token 0 is banned (min_tokens not reached)
    picks = {Sampler().sample(logits.clone(), ["a"], [SamplingParams(temperature=1.0, min_p=0.5, seed=s)], [(0,)],
                              [[1]], [1]).token_ids[0] for s in range(40)}
    assert picks == {1, 2}  # token 2 is 0.6 times as likely as token 1: kept
