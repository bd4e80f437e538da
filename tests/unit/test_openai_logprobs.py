"""Log-probabilities through the OpenAI frontend without a server: the models' JSON read, and OpenAI's chat and
completions shapes written from it, whole and streamed (one chunk per token, each with its own)."""

from __future__ import annotations

import asyncio
import json

import pytest

from frontend.openai.logprobs import parse_logprobs
from frontend.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from frontend.openai.serving import Answer
from frontend.openai.triton_bridge import Piece
from tests.fakes import FakeGeneration

# Two tokens as the models send them: the first sampled at rank 1, the second at rank 3 (outside a top 2).
MODEL_JSON = json.dumps([
    {"5": {"logprob": -0.1, "rank": 1, "decoded_token": "Hi"}, "6": {"logprob": -2.5, "rank": 2,
                                                                    "decoded_token": " yo"}},
    {"9": {"logprob": -1.5, "rank": 3, "decoded_token": "!"}, "7": {"logprob": -0.5, "rank": 1, "decoded_token": "."},
     "8": {"logprob": -1.0, "rank": 2, "decoded_token": ","}},
])
TOKENS = parse_logprobs(MODEL_JSON)


def answer(kind: str, stream: bool, pieces, **fields) -> Answer:
    if kind == "chat":
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], stream=stream,
                                        **fields)
    else:
        request = CompletionRequest(model="m", prompt="Hi", stream=stream, **fields)
    request.check_supported()
    return Answer(kind, "m", request, FakeGeneration(pieces[0], pieces[1:]), pieces[0], "id-1", 1_700_000_000)


def test_the_models_json_is_read_sampled_token_first_and_the_likeliest_by_rank():
    first, second = TOKENS
    assert (first.token, first.logprob, first.top) == ("Hi", -0.1, (("Hi", -0.1), (" yo", -2.5)))
    assert (second.token, second.logprob) == ("!", -1.5)
    assert second.top[:2] == ((".", -0.5), (",", -1.0))  # the sampled token is not among the best two


def test_chat_asks_the_models_for_top_logprobs_and_answers_in_openais_shape():
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                    top_logprobs=2)
    inputs = request.generation_request("x")
    assert inputs.return_logprobs is True and inputs.sampling_parameters == {"max_tokens": None, "logprobs": 2}
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}]).generation_request(
        "x").return_logprobs is None
    with pytest.raises(APIError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], top_logprobs=2
                              ).check_supported()
    whole = asyncio.run(answer("chat", False, [Piece("Hi!", 2, "length", 3, 2, TOKENS)], logprobs=True,
                               top_logprobs=2).whole())
    content = whole.model_dump()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hi", "!"] and content[1]["bytes"] == [33]
    assert [t["token"] for t in content[1]["top_logprobs"]] == [".", ","]


def test_completions_logprobs_whole_and_streamed_one_chunk_per_token():
    whole = asyncio.run(answer("completion", False, [Piece("Hi!", 2, "length", 3, 2, TOKENS)], logprobs=1).whole())
    logprobs = whole.model_dump()["choices"][0]["logprobs"]
    assert logprobs == {"tokens": ["Hi", "!"], "token_logprobs": [-0.1, -1.5], "top_logprobs": [{"Hi": -0.1},
                        {".": -0.5}], "text_offset": [0, 2]}

    async def collect(a):
        return [line async for line in a.events()]

    lines = asyncio.run(collect(answer("completion", True, [Piece("Hi!", 2, None, 3, 2, TOKENS),
                                                            Piece("", 0, "length", 3, 2)], logprobs=0)))
    events = [json.loads(e.removeprefix("data: ")) for line in lines for e in line.split("\n\n")
              if e and e != "data: [DONE]"]
    chunks = [e["choices"][0] for e in events if e["choices"][0]["logprobs"]]
    assert [c["text"] for c in chunks] == ["Hi!", ""]
    assert [c["logprobs"]["tokens"] for c in chunks] == [["Hi"], ["!"]]
    assert [c["logprobs"]["text_offset"] for c in chunks] == [[0], [2]]
    chat_lines = asyncio.run(collect(answer("chat", True, [Piece("Hi!", 2, "length", 3, 2, TOKENS)],
                                            logprobs=True)))
    chat = [json.loads(e.removeprefix("data: ")) for line in chat_lines for e in line.split("\n\n")
            if e and e != "data: [DONE]"]
    per_token = [e["choices"][0]["logprobs"]["content"] for e in chat if e["choices"][0].get("logprobs")]
    assert [[c["token"] for c in content] for content in per_token] == [["Hi"], ["!"]]


def test_vllm_extras_travel_in_sampling_parameters_and_hints_are_accepted():
    request = CompletionRequest(model="m", prompt="Hi", presence_penalty=0.5, repetition_penalty=1.1, min_p=0.05,
                                logit_bias={"42": -100}, stop_token_ids=[7], include_stop_str_in_output=True,
                                skip_special_tokens=False, cache_salt="tenant-a", use_beam_search=False,
                                spaces_between_special_tokens=True)
    request.check_supported()
    assert request.generation_request("Hi").sampling_parameters == {
        "presence_penalty": 0.5, "repetition_penalty": 1.1, "min_p": 0.05, "logit_bias": {"42": -100.0},
        "stop_token_ids": [7], "include_stop_str_in_output": True, "skip_special_tokens": False}
    assert CompletionRequest(model="m", prompt="Hi").generation_request("Hi").sampling_parameters is None
    for refused in ({"use_beam_search": True}, {"guided_whitespace_pattern": " "}, {"truncate_prompt_tokens": 5}):
        with pytest.raises(APIError) as error:
            CompletionRequest(model="m", prompt="Hi", **refused).check_supported()
        assert error.value.param == next(iter(refused)) and error.value.code == "unsupported_parameter"
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                 echo=False, chat_template_kwargs={})
    chat.check_supported()
    with pytest.raises(APIError):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}],
                              continue_final_message=True).check_supported()


def test_continuous_usage_stats_put_the_counts_so_far_in_every_chunk():
    async def collect(a):
        return [line async for line in a.events()]

    for kind in ("chat", "completion"):
        pieces = [Piece("Hel", 1, None, 3, 1), Piece("lo, you", 3, None, 3, 4), Piece("!", 1, "length", 3, 5)]
        a = answer(kind, True, pieces, stream_options={"include_usage": True, "continuous_usage_stats": True})
        assert a.request.generation_request("x").return_num_output_tokens is True
        events = [json.loads(e.removeprefix("data: ")) for line in asyncio.run(collect(a))
                  for e in line.split("\n\n") if e and e != "data: [DONE]"]
        counts = [e["usage"]["completion_tokens"] for e in events]
        expected = ([0] if kind == "chat" else []) + [1, 2, 3, 4, 5, 5, 5]  # role, tokens, finish, usage chunk
        assert counts == expected, kind
        assert all(e["usage"]["prompt_tokens"] == 3 for e in events)


# The prompt "Hi there" as the models send its prompt_logprobs (vLLM's: the first token's entry null).
PROMPT_JSON = [None, {"11": {"logprob": -3.0, "rank": 4, "decoded_token": " there"},
                      "12": {"logprob": -0.7, "rank": 1, "decoded_token": "!"},
                      "13": {"logprob": -1.2, "rank": 2, "decoded_token": ","}}]


def echo_answer(stream: bool, pieces, n: int = 1, **fields) -> Answer:
    request = CompletionRequest(model="m", prompt="Hi there", stream=stream, echo=True, n=n, **fields)
    request.check_supported()
    return Answer("completion", "m", request, FakeGeneration(pieces[0], pieces[1:], n), pieces[0], "id-1",
                  1_700_000_000, request.echoed("Hi there"))


def test_echo_with_logprobs_answers_the_prompts_tokens_first_in_openais_legacy_shape():
    request = CompletionRequest(model="m", prompt="Hi there", echo=True, logprobs=2)
    assert request.generation_request("Hi there").sampling_parameters == {"logprobs": 2, "prompt_logprobs": 2}
    pieces = [Piece("Hi!", 2, "length", 2, 2, TOKENS, prompt_logprobs=PROMPT_JSON)]
    whole = asyncio.run(echo_answer(False, pieces, logprobs=2).whole()).model_dump(exclude_unset=True)
    choice = whole["choices"][0]
    assert choice["text"] == "Hi thereHi!" and "prompt_logprobs" not in choice
    assert choice["logprobs"] == {
        "tokens": ["Hi", " there", "Hi", "!"],
        "token_logprobs": [None, -3.0, -0.1, -1.5],  # the first prompt token has nothing before it
        "top_logprobs": [None, {"!": -0.7, ",": -1.2}, {"Hi": -0.1, " yo": -2.5}, {".": -0.5, ",": -1.0}],
        "text_offset": [0, 2, 8, 10],
    }


def test_echo_with_logprobs_streams_the_prompts_tokens_in_the_echo_chunk():
    async def collect(a):
        return [line async for line in a.events()]

    pieces = [Piece("Hi!", 2, None, 2, 2, TOKENS, prompt_logprobs=PROMPT_JSON), Piece("", 0, "length", 2, 2)]
    lines = asyncio.run(collect(echo_answer(True, pieces, logprobs=1)))
    events = [json.loads(e.removeprefix("data: ")) for line in lines for e in line.split("\n\n")
              if e and e != "data: [DONE]"]
    chunks = [e["choices"][0] for e in events if e["choices"][0]["logprobs"]]
    assert [c["text"] for c in chunks] == ["Hi there", "Hi!", ""]
    assert chunks[0]["logprobs"] == {"tokens": ["Hi", " there"], "token_logprobs": [None, -3.0],
                                     "top_logprobs": [None, {"!": -0.7}], "text_offset": [0, 2]}
    assert [c["logprobs"]["text_offset"] for c in chunks[1:]] == [[8], [10]]  # after the echoed prompt


def test_n_choices_echo_the_prompts_logprobs_whichever_response_brought_them():
    pieces = [Piece("a", 1, "stop", 2, 1, TOKENS[:1], index=1, prompt_logprobs=PROMPT_JSON),
              Piece("b", 1, "stop", 2, 1, TOKENS[1:], index=0)]
    whole = asyncio.run(echo_answer(False, pieces, n=2, logprobs=0).whole()).model_dump(exclude_unset=True)
    for choice in whole["choices"]:
        assert choice["logprobs"]["tokens"][:2] == ["Hi", " there"]
        assert choice["logprobs"]["token_logprobs"][:2] == [None, -3.0]


def test_vllms_prompt_logprobs_field_comes_back_on_each_choice_in_vllms_shape():
    request = CompletionRequest(model="m", prompt="Hi there", prompt_logprobs=1)
    request.check_supported()
    assert request.generation_request("x").sampling_parameters == {"prompt_logprobs": 1}
    pieces = [Piece("Hi!", 2, "length", 2, 2, prompt_logprobs=PROMPT_JSON)]
    a = Answer("completion", "m", request, FakeGeneration(pieces[0], []), pieces[0], "id-1", 1_700_000_000)
    choice = asyncio.run(a.whole()).model_dump(exclude_unset=True)["choices"][0]
    assert choice["prompt_logprobs"] == PROMPT_JSON and choice.get("logprobs") is None
    with pytest.raises(APIError, match="whole answers only") as streamed:
        CompletionRequest(model="m", prompt="Hi", prompt_logprobs=1, stream=True).check_supported()
    assert streamed.value.param == "prompt_logprobs"
    with pytest.raises(ValueError):  # the engine's range
        CompletionRequest(model="m", prompt="Hi", prompt_logprobs=21)
    with pytest.raises(APIError) as chat:  # chat takes no prompt_logprobs
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}],
                              prompt_logprobs=1).check_supported()
    assert chat.value.param == "prompt_logprobs"


def test_the_bridge_reads_the_prompt_logprobs_output_of_a_response():
    import numpy as np

    from frontend.openai.triton_bridge import TritonGeneration

    class Result:
        outputs = {"text_output": np.array([b"Hi"], dtype=object), "output_ids": np.array([5], dtype=np.int32),
                   "prompt_logprobs": np.array([json.dumps(PROMPT_JSON).encode()], dtype=object)}

        def as_numpy(self, name):
            return self.outputs.get(name)

    piece = TritonGeneration(None, "prompt", "url")._piece(Result())
    assert piece.prompt_logprobs == PROMPT_JSON and piece.text == "Hi"
    del Result.outputs["prompt_logprobs"]
    assert TritonGeneration(None, "prompt", "url")._piece(Result()).prompt_logprobs is None
