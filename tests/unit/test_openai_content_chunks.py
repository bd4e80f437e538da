"""The frontend's streamed content chunks: rendered from a template once per answer, they must be the very lines
pydantic's chunk models render (what the OpenAI SDK and the benchmark tools parse), for any text a token can carry;
a chat stream's role chunk travels with its first token; and a Triton response that carries several tokens
(``stream_interval``) still makes one content chunk per token, since OpenAI's chunks carry no token ids and its
clients count a token per chunk."""

from __future__ import annotations

import asyncio
import json

import pytest

from frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from frontend.openai.serving import Answer
from frontend.openai.triton_bridge import Piece
from tests.fakes import FakeGeneration

TEXTS = ["", "Hello", " world", 'a "quoted" word', "back\\slash", "line\nbreak\ttab\r", "\x00\x01\x1f\x7f",
         "caf\u00e9 \u4e16\u754c \U0001f600", "\u2028\u2029", "</script>", "{\"content\":\"\"}"]


def answer(kind: str, include_usage: bool, pieces=(), n: int = 1) -> Answer:
    options = {"stream": True, "stream_options": {"include_usage": include_usage}}
    if kind == "chat":
        request = ChatCompletionRequest(model="llm_continuous", messages=[{"role": "user", "content": "Hi"}],
                                        n=n, **options)
    else:
        request = CompletionRequest(model="llm_continuous", prompt="Hi", n=n, **options)
    pieces = list(pieces) or [Piece("", 0, "stop", 1, 0)]
    generation = FakeGeneration(pieces[0], pieces[1:], n)
    return Answer(kind, "llm_continuous", request, generation, pieces[0], "id-1", 1_700_000_000)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_content_chunk_is_the_line_pydantic_renders(kind, include_usage):
    a = answer(kind, include_usage)
    for text in TEXTS:
        assert a._content(text) == a._event(text=text), text
        event = json.loads(a._content(text).removeprefix("data: "))
        got = event["choices"][0]["delta"]["content"] if kind == "chat" else event["choices"][0]["text"]
        assert got == text


def stream(kind: str, pieces, include_usage: bool = False) -> list[str]:
    """The stream's writes (one per yield; a write may hold several events)."""
    async def collect():
        return [line async for line in answer(kind, include_usage, pieces).events()]
    return asyncio.run(collect())


def events_of(lines: list[str]) -> list[dict]:
    return [json.loads(e.removeprefix("data: ")) for line in lines for e in line.split("\n\n")
            if e and e != "data: [DONE]"]


def test_the_role_chunk_goes_out_with_the_first_token():
    lines = stream("chat", [Piece("Hel", 1, None, 3, 1), Piece("lo", 1, "length", 3, 2)])
    events = [e for line in lines for e in line.split("\n\n") if e]
    deltas = [json.loads(e.removeprefix("data: "))["choices"][0]["delta"] for e in events if e != "data: [DONE]"]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert len(lines) == 4  # role + first token in one write, the second token, the finish, [DONE]


def test_a_stream_without_tokens_still_has_its_role_chunk():
    lines = stream("chat", [Piece("", 0, "stop", 3, 0)])
    events = [e for line in lines for e in line.split("\n\n") if e]
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(events[1].removeprefix("data: "))["choices"][0]["finish_reason"] == "stop"
    assert events[-1] == "data: [DONE]"


def test_a_response_of_several_tokens_becomes_one_chunk_per_token_with_the_same_text():
    each_token = [Piece("Hel", 1, None, 3, 1), Piece("lo", 1, None, 3, 2), Piece(",", 1, None, 3, 3),
                  Piece(" you", 1, None, 3, 4), Piece("!", 1, "length", 3, 5)]
    grouped = [Piece("Hel", 1, None, 3, 1), Piece("lo, you", 3, None, 3, 4), Piece("!", 1, "length", 3, 5)]
    for pieces in (each_token, grouped):
        events = events_of(stream("completion", pieces, include_usage=True))
        content = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"] is None]
        assert len(content) == 5 and "".join(e["choices"][0]["text"] for e in content) == "Hello, you!"
        assert events[-1]["usage"]["completion_tokens"] == 5
    grouped_events = events_of(stream("completion", grouped, include_usage=True))
    assert [e["choices"][0]["text"] for e in grouped_events[:5]] == ["Hel", "lo, you", "", "", "!"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_n_choices_stream_with_their_index_and_usage_counts_the_prompt_once(kind):
    pieces = [Piece("A", 1, None, 3, 1, index=0), Piece("B", 1, None, 3, 1, index=1),
              Piece("b", 1, "length", 3, 2, index=1), Piece("a", 1, "stop", 3, 2, index=0)]
    events = [json.loads(line.removeprefix("data: ")) for write in stream_n(kind, pieces)
              for line in write.split("\n\n") if line.startswith("data: {")]
    choices = [(e["choices"][0]["index"], e["choices"][0].get("finish_reason")) for e in events if e["choices"]]
    role_chunks = [(0, None), (1, None)] if kind == "chat" else []
    assert choices == role_chunks + [(0, None), (1, None), (1, None), (1, "length"), (0, None), (0, "stop")]
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_n_choices_whole_in_index_order(kind):
    pieces = [Piece("B", 1, None, 3, 1, index=1), Piece("Aa", 2, "stop", 3, 2, index=0),
              Piece("b", 1, "length", 3, 2, index=1)]
    whole = asyncio.run(answer(kind, False, pieces, n=2).whole())
    texts = [c.message.content if kind == "chat" else c.text for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1] and texts == ["Aa", "Bb"]
    assert [c.finish_reason for c in whole.choices] == ["stop", "length"]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (3, 4)


def stream_n(kind: str, pieces) -> list[str]:
    async def collect():
        return [line async for line in answer(kind, True, pieces, n=2).events()]
    return asyncio.run(collect())
