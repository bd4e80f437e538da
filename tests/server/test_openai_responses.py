"""OpenAI's Responses API (``POST /v1/responses``) in front of a real tritonserver, driven by the official SDK.

The tiny random Llama (SmolLM2's tokenizer and chat template) on all four models. Answers are compared with chat
completions' for the same messages, greedy; lengths are asked for with ``ignore_eos`` and ``max_output_tokens``,
never left to where EOS falls. The random model's text is noise: only the grammar makes a structured answer valid.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests
from pydantic import BaseModel, Field

from tests.responses_refusals import NOT_NEUTRAL
from tests.server.test_openai import MAX_MODEL_LEN, MESSAGES, MODELS, PERSON, leave_mid_stream

pytestmark = pytest.mark.server
GREEDY = {"temperature": 0.0}
EXACT = {"ignore_eos": True}  # with max_output_tokens: every answer is exactly that long


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def triton(openai_triton):
    return openai_triton  # test_openai.py's server, started once for both modules


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", MODELS)
def test_responses_are_chats_answers_streamed_or_not_on_every_model(sdk, model):
    chat = sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, extra_body=EXACT, **GREEDY)
    whole = sdk.responses.create(model=model, input=MESSAGES, max_output_tokens=8, extra_body=EXACT, **GREEDY)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == model
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens, 8)

    events = list(sdk.responses.create(model=model, input=MESSAGES, max_output_tokens=8, stream=True,
                                       extra_body=EXACT, **GREEDY))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 8, "one delta per token"
    assert "".join(deltas) == whole.output_text
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == whole.output_text

    # instructions are the system turn, first
    system, user = MESSAGES[0]["content"], MESSAGES[1]["content"]
    chat = sdk.chat.completions.create(model=model, messages=MESSAGES[:2], max_tokens=6, extra_body=EXACT, **GREEDY)
    instructed = sdk.responses.create(model=model, input=user, instructions=system, max_output_tokens=6,
                                      extra_body=EXACT, **GREEDY)
    assert instructed.output_text == chat.choices[0].message.content
    assert instructed.usage.input_tokens == chat.usage.prompt_tokens

    schema = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    structured = sdk.responses.create(model=model, input=MESSAGES, text=schema, max_output_tokens=200,
                                      temperature=1.0, extra_body={"seed": 3})
    person = json.loads(structured.output_text)
    assert structured.status == "completed", structured.output_text
    assert set(person) == {"name", "age"} and 0 <= person["age"] <= 120, structured.output_text


@pytest.mark.timeout(300)
def test_the_sdks_stream_helper_parses_a_structured_answer(sdk):
    with sdk.responses.stream(model="llm_continuous", input="Who are you?", text_format=Person, temperature=1.0,
                              max_output_tokens=200, extra_body={"seed": 5}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text
    assert isinstance(final.output_parsed, Person), final.output_text


@pytest.mark.timeout(300)
def test_the_stream_is_server_sent_events_as_openai_sends_them(frontend):
    body = {"model": "llm_continuous", "input": "Hi", "max_output_tokens": 3, "stream": True, "ignore_eos": True}
    with requests.post(f"{frontend.url}/v1/responses", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.text
    blocks = text.split("\n\n")
    assert blocks[-1] == ""
    kinds = []
    for block in blocks[:-1]:
        event, data = block.split("\n")
        kinds.append(event.removeprefix("event: "))
        assert json.loads(data.removeprefix("data: "))["type"] == kinds[-1]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 3, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.incomplete"]


BAD_REQUESTS = [
    # (fields beyond model and input, param)
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    *NOT_NEUTRAL,
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "42"}]}, "input.0.type"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": MAX_MODEL_LEN}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"frobnicate": True}, "frobnicate"),
]


@pytest.mark.timeout(300)
def test_what_the_server_cannot_honour_is_a_400_naming_it_and_the_next_request_is_served(frontend, sdk):
    failures = []
    for fields, param in BAD_REQUESTS:
        for stream in (False, True):
            body = {"model": "llm_continuous", "input": "Hi", "max_output_tokens": 4, **fields, "stream": stream}
            response = requests.post(f"{frontend.url}/v1/responses", json=body, timeout=60)
            error = response.json().get("error", {}) if response.status_code == 400 else {}
            if set(error) != {"message", "type", "param", "code"} or error["param"] != param:
                failures.append(f"{fields} stream={stream}: {response.status_code} {response.text}")
    assert not failures, "\n".join(failures)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model="llm_continuous", input="Hi", previous_response_id="resp_123")
    assert refused.value.param == "previous_response_id"
    served = sdk.responses.create(model="llm_continuous", input="Hi", max_output_tokens=3, extra_body=EXACT)
    assert served.usage.output_tokens == 3


@pytest.mark.timeout(300)
def test_a_client_that_leaves_mid_stream_has_its_triton_request_stopped(frontend, triton):
    model, max_tokens = "llm_continuous", MAX_MODEL_LEN - 64
    body = {"model": model, "input": "Tell me a long story", "max_output_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    # NOTE: as tests/server/test_openai.py's: on a loaded machine the whole answer can be made before this client
    # reads its fifth delta; then nothing was left to stop, and the test asks again (at most twice more).
    for attempt in range(3):
        _, _, generated = leave_mid_stream(frontend, triton, model, "/v1/responses", body,
                                           b"event: response.output_text.delta")
        if generated == max_tokens and attempt < 2:
            continue  # the answer was complete before the disconnect
        assert generated < max_tokens, f"the request ran to its end ({generated} tokens)"
        break
    assert "cancelling its stream" not in frontend.log_path.read_text()
