"""Length errors in the OpenAI client's terms (frontend/openai/context_length.py): tokens, not bytes, and each
parameter named as the client sent it; a prompt that surely fits is not tokenized at all."""

from __future__ import annotations

import asyncio

import pytest

from frontend.openai import context_length
from frontend.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


class CountingTokenizer:
    """One token per word; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [0] * len(text.split())


def check_prompt(tokenizer, prompt: str, param: str = "prompt", max_model_len: int = 100) -> None:
    asyncio.run(context_length.check_prompt(tokenizer, prompt, param, max_model_len))


def test_a_prompt_shorter_in_bytes_than_the_context_is_not_tokenized():
    tokenizer = CountingTokenizer()
    check_prompt(tokenizer, "word " * 18)  # 90 bytes < 100 - margin
    assert tokenizer.calls == 0


def test_a_long_prompt_is_counted_in_tokens_and_refused_only_when_it_leaves_no_room():
    tokenizer = CountingTokenizer()
    check_prompt(tokenizer, "longword " * 99)  # 891 bytes, but 99 tokens: one left for the output
    assert tokenizer.calls == 1
    with pytest.raises(APIError) as refused:
        check_prompt(tokenizer, "longword " * 100, param="messages")
    error = refused.value
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")
    assert error.message == ("This model's maximum context length is 100 tokens. However, your request has 100 input "
                             "tokens, which leaves no room for output. Please reduce the length of the messages.")


def test_a_huge_prompt_is_counted_up_to_a_bound_and_said_to_have_at_least_that_many_tokens(monkeypatch):
    monkeypatch.setattr(context_length, "MAX_COUNTED_BYTES", 1000)
    with pytest.raises(APIError, match="your request has at least 200 input tokens"):
        check_prompt(CountingTokenizer(), "word " * 10_000)


@pytest.mark.parametrize(("body", "param"), [
    (CompletionRequest(model="m", prompt="p", max_tokens=100), "max_tokens"),
    (ChatCompletionRequest(model="m", messages=MESSAGES, max_tokens=100), "max_tokens"),
    (ChatCompletionRequest(model="m", messages=MESSAGES, max_completion_tokens=100), "max_completion_tokens"),
])
def test_an_output_limit_the_context_cannot_hold_names_the_parameter_as_sent(body, param):
    context_length.check_max_tokens(99, body.max_tokens_param, 100)  # one token of prompt still fits
    with pytest.raises(APIError) as refused:
        context_length.check_max_tokens(body.requested_max_tokens, body.max_tokens_param, 100)
    assert (refused.value.param, refused.value.code) == (param, "context_length_exceeded")
    assert refused.value.message.startswith(f"'{param}' is too large: 100. This model's maximum context length is "
                                            "100 tokens")


def test_echo_repeats_the_prompt_of_a_completion_and_asks_for_its_logprobs_with_logprobs():
    assert CompletionRequest(model="m", prompt="p", echo=True).echoed("the prompt") == "the prompt"
    assert CompletionRequest(model="m", prompt="p").echoed("the prompt") == ""
    CompletionRequest(model="m", prompt="p", echo=True).check_supported()
    echo_logprobs = CompletionRequest(model="m", prompt="p", echo=True, logprobs=1)
    echo_logprobs.check_supported()
    assert echo_logprobs.generation_request("p").sampling_parameters == {"logprobs": 1, "prompt_logprobs": 1}
    assert "prompt_logprobs" not in CompletionRequest(model="m", prompt="p", logprobs=1).generation_request(
        "p").sampling_parameters
    with pytest.raises(APIError) as chat_echo:  # chat has no echo here
        ChatCompletionRequest(model="m", messages=MESSAGES, echo=True).check_supported()
    assert chat_echo.value.param == "echo"
