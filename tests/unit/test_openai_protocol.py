"""The OpenAI frontend's protocol without a server: which parameters are accepted, and how the models' errors map
onto OpenAI's statuses and codes. tests/server/test_openai.py runs the frontend against real tritonservers.
"""

from __future__ import annotations

import pytest

from backend.contract import errors
from backend.contract.errors import PROMPT, ErrorKind, message
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
        CompletionRequest(model="m", prompt="Hi", n=2, best_of=3).check_supported()
    assert refused.value.param == "best_of"
    chat_n = ChatCompletionRequest(model="m", messages=MESSAGES, n=3)
    chat_n.check_supported()  # n answers are served
    assert chat_n.generation_request("x").n == 3
    completion = CompletionRequest(model="m", prompt="Hi")
    completion.check_supported()
    assert completion.generation_request("Hi").max_tokens == 16  # OpenAI's default for completions
    chat = ChatCompletionRequest(model="m", messages=MESSAGES).generation_request("x")
    assert chat.max_tokens is None and chat.sampling_parameters == {"max_tokens": None}  # up to the context


# What vLLM's router 0.1.17 forwarded to a replica for a plain request (captured in front of a stand-in worker).
ROUTED_COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 4, "temperature": 0.0, "stream": True,
                     "stream_options": {"include_usage": True}, "echo": False, "seed": 3, "no_stop_trim": False,
                     "ignore_eos": True, "skip_special_tokens": True, "return_hidden_states": False, "priority": 0}
ROUTED_CHAT = {"model": "m", "messages": MESSAGES, "stream": False, "max_tokens": 4, "logprobs": False,
               "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
               "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False, "include_reasoning": True}


def test_what_the_routers_add_to_a_request_changes_nothing_and_no_stop_trim_keeps_the_stop_string():
    for request in (CompletionRequest(**ROUTED_COMPLETION), ChatCompletionRequest(**ROUTED_CHAT)):
        request.check_supported()
        assert "include_stop_str_in_output" not in (request.generation_request("x").sampling_parameters or {})
    kept = CompletionRequest(**{**ROUTED_COMPLETION, "no_stop_trim": True, "stop": ["."]})
    assert kept.generation_request("hi").sampling_parameters["include_stop_str_in_output"] is True
    with pytest.raises(APIError) as refused:
        CompletionRequest(**{**ROUTED_COMPLETION, "return_hidden_states": True}).check_supported()
    assert refused.value.param == "return_hidden_states"


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}}}},
     {"json": {"type": "integer"}}),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "a+"}}, {"regex": "a+"}),
    ({"guided_json": {"type": "object"}}, {"json": {"type": "object"}}),
    ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"guided_grammar": 'start: "x"'}, {"grammar": 'start: "x"'}),
])
def test_structured_output_fields_become_the_models_structured_outputs(fields, expected):
    request = ChatCompletionRequest(model="m", messages=MESSAGES, max_tokens=8, **fields)
    request.check_supported()
    sent = request.generation_request("x").sampling_parameters
    assert (sent or {}).get("structured_outputs") == expected


def test_structured_output_is_asked_for_once_in_a_known_format():
    with pytest.raises(APIError, match="send one of") as refused:
        ChatCompletionRequest(model="m", messages=MESSAGES, guided_regex="a", guided_choice=["b"]).check_supported()
    assert refused.value.param == "guided_regex"
    with pytest.raises(APIError, match="not supported") as refused:
        ChatCompletionRequest(model="m", messages=MESSAGES, response_format={"type": "xml"}).check_supported()
    assert refused.value.param == "response_format"
    completion = CompletionRequest(model="m", prompt="Hi", structured_outputs={"choice": ["a"]})
    assert completion.generation_request("Hi").sampling_parameters == {"structured_outputs": {"choice": ["a"]}}


@pytest.mark.parametrize("text, status, code, param", [
    (message(ErrorKind.OVERLOADED, "the server is overloaded: 4 requests are already waiting (max_queue_size=4)"),
     429, "model_overloaded", None),
    ("Exceeds maximum queue size", 429, "model_overloaded", None),  # Triton's own, the one text without a code
    (message(ErrorKind.SHUTTING_DOWN, "the server is shutting down"), 503, "service_unavailable", None),
    (message(ErrorKind.ENGINE_FAILED, "the engine failed and cannot go on (RuntimeError()); restart the server"), 503,
     "service_unavailable", None),
    (message(ErrorKind.ENGINE_FAULT, "the engine failed while running this request: RuntimeError: boom"), 500,
     "internal_error", None),
    (message(ErrorKind.DROPPED, "the server lost track of this request"), 503, "service_unavailable", None),
    (message(ErrorKind.CONTEXT_LENGTH_EXCEEDED, "the prompt has 600 tokens but max_model_len is 512", PROMPT), 400,
     "context_length_exceeded", "prompt"),
    (message(ErrorKind.CONTEXT_LENGTH_EXCEEDED, "the request may grow to 600 tokens", "max_tokens"), 400,
     "context_length_exceeded", "max_tokens"),
    (message(ErrorKind.INVALID_REQUEST, "top_k must be an integer >= 0", "top_k"), 400, None, "top_k"),
    (message(ErrorKind.INVALID_REQUEST, "at most 16 stop strings are allowed; got 17", "stop"), 400, None, "stop"),
    (message(ErrorKind.INVALID_REQUEST, "unknown sampling parameter(s): best_of"), 400, None, None),
    ("a message without a code", 500, "internal_error", None),  # not one of the models' errors
])
def test_model_errors_map_onto_openai_statuses(text, status, code, param):
    error = api_error(text, "prompt")
    assert (error.status, error.code, error.param) == (status, code, param)
    parsed = errors.parse(text)
    assert error.body()["error"]["message"] == (text if parsed is None else parsed.text), "the code is not repeated"
    assert api_error(text, "messages").param == ("messages" if param == "prompt" else param)
