"""The OpenAI frontend's protocol without a server: which parameters are accepted, and how the models' errors map
onto OpenAI's statuses and codes. tests/server/test_openai.py runs the frontend against real tritonservers.
"""

from __future__ import annotations

import pytest

from frontend.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from frontend.openai.triton_bridge import api_error

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]


def test_neutral_values_of_unsupported_parameters_are_accepted():
    request = ChatCompletionRequest(model="m", messages=MESSAGES, n=1, presence_penalty=0.0, frequency_penalty=0,
                                    logprobs=False, tools=[], tool_choice="none", response_format={"type": "text"},
                                    logit_bias={}, store=False, user="someone")
    request.check_supported()
    with pytest.raises(APIError) as refused:
        ChatCompletionRequest(model="m", messages=MESSAGES, n=3).check_supported()
    assert refused.value.param == "n"
    completion = CompletionRequest(model="m", prompt="Hi")
    completion.check_supported()
    assert completion.generation_request("Hi").max_tokens == 16  # OpenAI's default for completions
    chat = ChatCompletionRequest(model="m", messages=MESSAGES).generation_request("x")
    assert chat.max_tokens is None and chat.sampling_parameters == {"max_tokens": None}  # up to the context


@pytest.mark.parametrize("message, status, code, param", [
    ("the server is overloaded: 4 requests are already waiting (max_queue_size=4); retry later", 429,
     "model_overloaded", None),
    ("Exceeds maximum queue size", 429, "model_overloaded", None),
    ("the server is shutting down", 503, "service_unavailable", None),
    ("the engine failed and cannot go on (RuntimeError()); restart the server", 503, "service_unavailable", None),
    ("the engine failed while running this request: RuntimeError: boom", 500, "internal_error", None),
    ("the prompt has 600 tokens but max_model_len is 512, which leaves no room", 400, "context_length_exceeded",
     "prompt"),
    ("text_input is 25000 bytes; the limit is 8192 bytes (16 per token of max_model_len 512)", 400,
     "context_length_exceeded", "prompt"),
    ("the request may grow to 600 tokens (prompt + max_tokens, capped by max_model_len), more than the whole KV "
     "cache holds (16 blocks of 16 tokens); lower max_tokens", 400, "context_length_exceeded", "max_tokens"),
    ("top_k must be an integer >= 0", 400, None, None),
])
def test_model_errors_map_onto_openai_statuses(message, status, code, param):
    error = api_error(message, "prompt")
    assert (error.status, error.code, error.param) == (status, code, param)
    assert error.body()["error"]["message"] == message
