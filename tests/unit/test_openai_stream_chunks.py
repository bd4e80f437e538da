"""The OpenAI frontend's stream keeps one content chunk per token when a Triton response carries several
(``stream_interval``): OpenAI's chunks carry no token ids, so its clients count a token per chunk."""

from __future__ import annotations

import asyncio
import json

from frontend.openai.protocol import CompletionRequest
from frontend.openai.serving import Answer
from frontend.openai.triton_bridge import Piece


class FakeGeneration:
    def __init__(self, pieces: list[Piece]) -> None:
        self._pieces = iter(pieces)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Piece:
        try:
            return next(self._pieces)
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        pass


def stream_events(pieces: list[Piece]) -> list[dict]:
    request = CompletionRequest(model="llm_continuous", prompt="hi", stream=True,
                                stream_options={"include_usage": True})
    generation = FakeGeneration(pieces[1:])
    answer = Answer("completion", "llm_continuous", request, generation, pieces[0], "cmpl-1", 0)

    async def collect():
        return [line async for line in answer.events()]

    lines = asyncio.run(collect())
    return [json.loads(line[len("data: "):]) for line in lines if not line.startswith("data: [DONE]")]


def test_a_response_of_several_tokens_becomes_one_chunk_per_token_with_the_same_text():
    each_token = [Piece("Hel", 1, None, 3, 1), Piece("lo", 1, None, 3, 2), Piece(",", 1, None, 3, 3),
                  Piece(" you", 1, None, 3, 4), Piece("!", 1, "length", 3, 5)]
    grouped = [Piece("Hel", 1, None, 3, 1), Piece("lo, you", 3, None, 3, 4), Piece("!", 1, "length", 3, 5)]
    for pieces in (each_token, grouped):
        events = stream_events(pieces)
        content = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"] is None]
        assert len(content) == 5 and "".join(e["choices"][0]["text"] for e in content) == "Hello, you!"
        assert events[-1]["usage"]["completion_tokens"] == 5
    assert [e["choices"][0]["text"] for e in stream_events(grouped)[:5]] == ["Hel", "lo, you", "", "", "!"]
