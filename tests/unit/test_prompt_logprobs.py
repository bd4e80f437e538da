"""vLLM's ``prompt_logprobs``: each prompt token's log-probability and the k likeliest at its position, computed from
the prefill's logits, equal to a plain float32 log-softmax over one forward of the whole prompt, whatever the chunking;
returned once, in the request's first output; no LM-head row for a request that does not ask (tiny random Llama)."""

from __future__ import annotations

import pytest
import torch

from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine, RequestOutput
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import ScheduledRequest

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs away into the woods."
K = 3
ATOL = 1e-4


def make_engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(model=str(model_dir), dtype="float32", num_threads=1, max_num_seqs=8, max_model_len=256,
                    num_kv_blocks=64, block_size=8)
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


def run(engine: LLMEngine, requests: dict[str, SamplingParams], prompt: str = PROMPT) -> list[RequestOutput]:
    for request_id, params in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def direct_logprobs(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:  # (P, V) float32
    """One forward of the whole prompt with a row at every position, log-softmax in float32 (the engine is idle:
    its first blocks are scratch)."""
    runner = engine.runner
    request = Request("direct", token_ids)
    request.block_ids = list(range(-(-len(token_ids) // engine.config.block_size)))
    inputs = runner.prepare([ScheduledRequest.of(request, len(token_ids))])
    logits = runner.model.forward(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta,
                                  torch.arange(len(token_ids)))
    return logits.float().log_softmax(dim=-1)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


def first_output(outputs: list[RequestOutput], request_id: str) -> RequestOutput:
    return next(out for out in outputs if out.request_id == request_id)


def test_prompt_logprobs_equal_a_float32_log_softmax_of_the_whole_prompt(engine):
    outputs = run(engine, {"p": SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K)})
    token_ids = engine.tokenizer.encode(PROMPT)
    found = first_output(outputs, "p").prompt_logprobs
    assert len(found) == len(token_ids) and found[0] is None  # nothing precedes the first token
    expected = direct_logprobs(engine, token_ids)
    decode = engine.tokenizer.hf.decode
    for p, ranked in enumerate(found[1:]):
        row, token_id = expected[p], token_ids[p + 1]
        (first_id, first), *top = ranked.items()
        assert first_id == token_id and first.decoded_token == decode([token_id])  # the prompt token first
        assert first.logprob == pytest.approx(row[token_id].item(), abs=ATOL)
        assert first.rank == int((row > row[token_id]).sum()) + 1
        values, ids = row.topk(K)
        likeliest = {tid: lp for tid, lp in ranked.items() if lp.rank <= K}
        assert set(likeliest) == set(ids.tolist())
        for tid, value in zip(ids.tolist(), values.tolist()):
            assert likeliest[tid].logprob == pytest.approx(value, abs=ATOL)
        assert len(ranked) in (K, K + 1)  # the prompt token, and the likeliest that are not it
    assert [out.prompt_logprobs for out in outputs[1:]] == [None]  # once, in the first output


def test_chunked_prefill_gives_what_one_chunk_gives(tiny_llama_dir, engine):
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    whole = first_output(run(engine, {"w": params}), "w")
    chunked_engine = make_engine(tiny_llama_dir, max_num_batched_tokens=8)
    chunked = first_output(run(chunked_engine, {"c": params}), "c")
    assert chunked.finished and chunked.new_token_ids == whole.new_token_ids
    assert len(chunked.prompt_logprobs) == len(whole.prompt_logprobs) > 8  # several chunks
    assert chunked.prompt_logprobs[0] is None
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert list(a) == list(b)
        for tid in a:
            assert (a[tid].rank, a[tid].decoded_token) == (b[tid].rank, b[tid].decoded_token)
            assert a[tid].logprob == pytest.approx(b[tid].logprob, abs=ATOL)


def test_a_request_that_does_not_ask_costs_no_lm_head_row(engine):
    asking = Request("a", [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=0))
    plain = Request("b", [6, 7, 8, 9], SamplingParams())
    for i, request in enumerate((asking, plain)):
        request.block_ids = [i]
    inputs = engine.runner.prepare([ScheduledRequest.of(asking, 5), ScheduledRequest.of(plain, 4)])
    assert len(inputs.logits_indices) == 2 + 4  # two sampled rows, and positions 0-3 of the asking prompt
    assert [(r.request.request_id, r.start, r.num_positions) for r in inputs.prompt_rows] == [("a", 0, 4)]
    plain_only = engine.runner.prepare([ScheduledRequest.of(plain, 4)])
    assert len(plain_only.logits_indices) == 1 and plain_only.prompt_rows == ()

    outputs = run(engine, {"plain": SamplingParams(max_tokens=2), "zero": SamplingParams(max_tokens=2,
                                                                                        prompt_logprobs=0)})
    assert all(out.prompt_logprobs is None for out in outputs if out.request_id == "plain")
    zero = first_output(outputs, "zero").prompt_logprobs
    assert zero[0] is None and all(len(ranked) == 1 for ranked in zero[1:])  # the prompt token alone


def test_n_sequences_get_the_prompts_logprobs_once_with_sequence_0s_first_output(engine):
    outputs = run(engine, {"n": SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=5, prompt_logprobs=1)})
    carrying = [out for out in outputs if out.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].index == 0 and carrying[0] is outputs[0]
    assert len(carrying[0].prompt_logprobs) == len(engine.tokenizer.encode(PROMPT))
    assert sum(out.finished for out in outputs) == 1  # still one final output


def test_a_request_for_prompt_logprobs_skips_the_prefix_cache(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, enable_prefix_caching=True)
    run(engine, {"warm": SamplingParams(max_tokens=1)})
    hit = first_output(run(engine, {"hit": SamplingParams(max_tokens=1)}), "hit")
    assert hit.num_cached_tokens > 0
    asking = first_output(run(engine, {"asking": SamplingParams(max_tokens=1, prompt_logprobs=1)}), "asking")
    assert asking.num_cached_tokens == 0
    assert len(asking.prompt_logprobs) == asking.num_prompt_tokens and asking.prompt_logprobs[1] is not None


def test_a_one_token_prompt_has_just_its_none(engine):
    token_id = engine.tokenizer.encode(PROMPT)[0]
    engine.add_request("one", [token_id], SamplingParams(max_tokens=1, prompt_logprobs=2))
    (out,) = engine.step()
    assert out.prompt_logprobs == [None]
