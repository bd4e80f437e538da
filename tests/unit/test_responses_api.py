"""OpenAI's Responses API (frontend/openai/responses_api.py) without a server: what a request may carry, how its input
becomes chat's messages, and the Response and its events as the official SDK parses them, from fake Triton pieces
behind the real app. tests/server/test_openai_responses.py runs it against real tritonservers.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import contextmanager

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import ResponseTextDeltaEvent

from frontend.openai import app as app_module
from frontend.openai.app import Settings, create_app
from frontend.openai.protocol import APIError, ChatMessage
from frontend.openai.responses_api import ResponseAnswer, ResponsesRequest
from frontend.openai.triton_bridge import Piece
from tests.responses_refusals import NOT_NEUTRAL
from tests.unit.test_openai_load import PresentTriton

HELLO = [Piece("He", 1, None, 7, 1), Piece("llo", 2, None, 7, 3), Piece("!", 1, "stop", 7, 4)]
CUT = [Piece("He", 1, None, 7, 1), Piece("llo", 1, "length", 7, 2)]
STREAMED = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            *["response.output_text.delta"] * 4, "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.completed"]


def request(**fields) -> ResponsesRequest:
    request = ResponsesRequest.model_validate({"model": "m", "input": "Hi", **fields})
    request.check_supported()
    return request


# ---- the request ------------------------------------------------------------------------------------------------


def test_input_becomes_chats_messages_with_the_instructions_first():
    assert request().messages() == [ChatMessage(role="user", content="Hi")]
    items = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name "},
                                                         {"type": "input_text", "text": "a colour."}]},
        # an earlier response's output, sent back as the SDK dumps it
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Blue.", "annotations": [], "logprobs": []}]},
        {"role": "user", "content": "Another one?"},
    ]
    assert request(input=items, instructions="You are a painter.").messages() == [
        ChatMessage(role="system", content="You are a painter."),
        ChatMessage(role="developer", content="Be terse."),
        ChatMessage(role="user", content="Name a colour."),
        ChatMessage(role="assistant", content="Blue."),
        ChatMessage(role="user", content="Another one?"),
    ]


def test_parameters_become_the_models_inputs():
    sent = request(max_output_tokens=12, temperature=0.5, top_p=0.9, seed=3, ignore_eos=True, min_tokens=2, top_k=5,
                   metadata={"k": "v"}, user="u", store=False, parallel_tool_calls=False, tools=[], tool_choice="auto",
                   truncation="disabled", top_logprobs=0, include=[], stream=True,
                   stream_options={"include_obfuscation": False}).generation_request("prompt")
    assert (sent.max_tokens, sent.temperature, sent.top_p, sent.seed, sent.ignore_eos, sent.min_tokens, sent.top_k) \
        == (12, 0.5, 0.9, 3, True, 2, 5)
    assert sent.stream and sent.return_num_output_tokens is None
    assert request().generation_request("prompt").sampling_parameters == {"max_tokens": None}  # up to the context


@pytest.mark.parametrize("fmt, expected", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"json_object": True}),
    ({"type": "json_schema", "name": "p", "schema": {"type": "integer"}, "strict": True},
     {"json": {"type": "integer"}}),
])
def test_text_format_asks_for_chats_structured_output(fmt, expected):
    sent = request(text={"format": fmt}).generation_request("prompt").sampling_parameters
    assert sent.get("structured_outputs") == expected


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    *NOT_NEUTRAL,
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_object"}}, "guided_regex": "a+"}, "text.format"),
    ({"use_beam_search": True}, "use_beam_search"),  # chat's refusals hold here too
])
def test_what_the_engine_cannot_honour_is_a_400_naming_it(fields, param):
    with pytest.raises(APIError) as refused:
        request(**fields)
    assert (refused.value.status, refused.value.param) == (400, param)


# ---- the answer, from fake pieces -------------------------------------------------------------------------------


class FakeGeneration:
    """Triton's responses for one request, as :class:`TritonGeneration` hands them out."""

    def __init__(self, pieces: list[Piece], error: APIError | None = None) -> None:
        self.pieces, self.error, self.n = list(pieces), error, 1
        self.finished = self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Piece:
        if self.finished:
            raise StopAsyncIteration
        if not self.pieces:
            self.finished = True
            raise self.error
        piece = self.pieces.pop(0)
        self.finished = piece.finish_reason is not None
        return piece

    async def aclose(self) -> None:
        self.closed = True


def answer_of(pieces: list[Piece], error: APIError | None = None, **fields) -> ResponseAnswer:
    generation = FakeGeneration(pieces, error)
    return ResponseAnswer(request(**fields), generation, generation.pieces.pop(0))


def events_of(answer: ResponseAnswer) -> list[tuple[str, dict]]:
    async def read() -> str:
        return "".join([chunk async for chunk in answer.events()])

    events = []
    for block in asyncio.run(read()).split("\n\n")[:-1]:
        kind, data = block.split("\n")
        events.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_the_whole_answer_is_one_message_and_the_models_counts():
    answer = answer_of(HELLO, instructions="Be terse.", metadata={"k": "v"})
    response = asyncio.run(answer.whole())
    assert answer.generation.closed
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == "Hello!" and response.incomplete_details is None
    (message,) = response.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (7, 4, 11)
    assert response.instructions == "Be terse." and response.metadata == {"k": "v"} and response.tools == []
    assert response.model_dump()["store"] is False

    cut = asyncio.run(answer_of(CUT, max_output_tokens=2).whole())
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.max_output_tokens == 2


def test_the_stream_is_openais_events_one_delta_per_token():
    answer = answer_of(HELLO)
    events = events_of(answer)
    assert answer.generation.closed
    assert [kind for kind, _ in events] == STREAMED
    assert [data["type"] for _, data in events] == STREAMED
    assert [data["sequence_number"] for _, data in events] == list(range(len(STREAMED)))
    assert [data["delta"] for _, data in events[4:8]] == ["He", "llo", "", "!"]
    assert events[-4][1]["text"] == "Hello!" and events[-3][1]["part"]["text"] == "Hello!"
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 4
    assert final["output"] == [events[-2][1]["item"]]

    cut = events_of(answer_of(CUT, max_output_tokens=2))
    assert cut[-1][0] == "response.incomplete"
    assert cut[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_error_mid_stream_is_an_error_event_that_ends_it():
    error = APIError(503, "the server aborted the request", "server_error", None, "service_unavailable")
    answer = answer_of(HELLO[:1], error)
    events = events_of(answer)
    assert answer.generation.closed
    assert [kind for kind, _ in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1][1] == {"type": "error", "code": "service_unavailable", "message": error.message, "param": None,
                             "sequence_number": 5}


def test_the_fast_delta_is_what_the_sdks_type_renders():
    answer = answer_of(HELLO)
    text = 'a "quote" \\ \n\t ü 日本 😀 \u2028 \x01'
    fast = answer._delta(text)
    event = ResponseTextDeltaEvent(type="response.output_text.delta", item_id=answer.message_id, output_index=0,
                                   content_index=0, delta=text, logprobs=[], sequence_number=0)
    assert fast == answer._event(event)


# ---- the route, with the official SDK, in front of fake Triton pieces -------------------------------------------


class FakeBridge:
    """Triton as the route sees it: one served model, and the given pieces for every request."""

    def __init__(self, pieces: list[Piece]) -> None:
        self.pieces, self.sent, self.generations = pieces, [], []

    async def model_config(self, model: str) -> dict:
        if model != "llm_continuous":
            raise APIError(404, f"The model '{model}' does not exist", "invalid_request_error", "model",
                           "model_not_found")
        return {"max_batch_size": 0, "parameters": {"max_model_len": {"string_value": "512"}}}

    async def generate(self, model, generation_request, prompt_param) -> FakeGeneration:
        self.sent.append((generation_request, prompt_param))
        self.generations.append(FakeGeneration(self.pieces))
        return self.generations[-1]

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def app(smollm2_dir):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app_module, "TritonHealth", PresentTriton)
        yield create_app(Settings("127.0.0.1:1", str(smollm2_dir)))


@contextmanager
def serve(app, pieces: list[Piece]):
    """The test client, an SDK on it and the fake bridge that answers ``pieces`` in place of the app's own."""
    with TestClient(app) as client:
        bridge = app.state.bridge = FakeBridge(pieces)
        yield client, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client,
                                    max_retries=0), bridge


def test_the_sdk_reads_the_answer_and_its_stream(app):
    with serve(app, HELLO) as (client, sdk, bridge):
        whole = sdk.responses.create(model="llm_continuous", input="Hi", instructions="Be terse.")
        assert whole.output_text == "Hello!" and whole.status == "completed" and whole.usage.output_tokens == 4
        generation_request, prompt_param = bridge.sent[-1]
        assert prompt_param == "input" and not generation_request.stream
        assert generation_request.text_input.startswith("<|im_start|>system\nBe terse.<|im_end|>\n")
        assert generation_request.text_input.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        # the answer's output sent back as input, as the SDK dumps it: an assistant turn
        sdk.responses.create(model="llm_continuous", input=[{"role": "user", "content": "Hi"}, *whole.output,
                                                            {"role": "user", "content": "More"}])
        assert bridge.sent[-1][0].text_input.endswith("<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n"
                                                      "More<|im_end|>\n<|im_start|>assistant\n")

        events = list(sdk.responses.create(model="llm_continuous", input="Hi", stream=True))
        assert [e.type for e in events] == STREAMED
        assert events[-1].response.output_text == "Hello!" and bridge.sent[-1][0].stream
        assert all(g.closed for g in bridge.generations)

        with sdk.responses.stream(model="llm_continuous", input="Hi") as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
        assert "".join(deltas) == final.output_text == "Hello!"


def test_the_route_answers_400s_in_openais_body(app):
    with serve(app, HELLO) as (client, sdk, _):
        for body, param in [
            ({"previous_response_id": "resp_1"}, "previous_response_id"),
            ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input.0.type"),
            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
             "input.0.content.0"),
            ({"input": []}, "input"),
            ({"text": {"format": {"type": "yaml"}}}, "text.format"),
            ({"frobnicate": 1}, "frobnicate"),
            ({"max_output_tokens": 4096}, "max_output_tokens"),
        ]:
            response = client.post("/v1/responses", json={"model": "llm_continuous", "input": "Hi", **body})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param, (body, response.json())
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(model="llm_continuous", input="Hi", background=True)
        assert refused.value.param == "background"
        assert sdk.responses.create(model="llm_continuous", input="Hi").output_text == "Hello!"
