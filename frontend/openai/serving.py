"""The OpenAI answers for completions and chat: one JSON response, or server-sent events as OpenAI streams them.

A stream is: (chat) a role chunk, one content chunk per token (a Triton response that carries several tokens, sent
every ``stream_interval`` steps, becomes its text in one chunk and an empty chunk for each further token; each with
its token's log-probabilities when asked), a chunk with the ``finish_reason`` and an empty delta, the usage chunk
when ``stream_options.include_usage`` asks (then every other chunk carries ``"usage": null``, or the counts so far
with vLLM's ``continuous_usage_stats``), and ``data: [DONE]``. An error after the first token is sent as
``data: {"error": ...}`` before ``[DONE]``; one before it is an HTTP error (the first Triton response is awaited
before the stream starts, so a refused request gets its status).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Literal

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from frontend.openai.logprobs import TokenLogprob, chat_logprobs, completion_logprobs
from frontend.openai.protocol import APIError, SamplingRequest
from frontend.openai.triton_bridge import Piece, TritonBridge, TritonGeneration

DONE = "data: [DONE]\n\n"


class CompletionChunkChoice(CompletionChoice):
    """A streamed completion's choice: no finish reason until the last chunk (OpenAI's type requires one)."""

    finish_reason: Literal["stop", "length"] | None = None


class CompletionChunk(Completion):
    choices: list[CompletionChunkChoice]


@dataclass
class Answer:
    """One generation in progress: its Triton request, the first response, and what the OpenAI answer needs."""

    kind: Literal["chat", "completion"]
    model: str
    request: SamplingRequest
    generation: TritonGeneration
    first: Piece
    id: str
    created: int
    _content_parts: tuple[str, str] | None = field(default=None, init=False, repr=False)
    _text_offset: int = field(default=0, init=False, repr=False)  # completions' logprobs: the text streamed so far

    @classmethod
    async def start(cls, bridge: TritonBridge, kind, model: str, request: SamplingRequest, prompt: str) -> "Answer":
        """Send the request and wait for its first response: an error before any token raises :class:`APIError`."""
        prompt_param = "messages" if kind == "chat" else "prompt"
        generation = await bridge.generate(model, request.generation_request(prompt), prompt_param)
        try:
            first = await generation.__anext__()
        except BaseException:
            await generation.aclose()
            raise
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, model, request, generation, first, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    # -- one JSON answer

    async def whole(self) -> ChatCompletion | Completion:
        """The whole answer (the models send it in one response when ``stream`` is false)."""
        pieces = [self.first]
        try:
            async for piece in self.generation:
                pieces.append(piece)
        finally:
            await self.generation.aclose()
        text, last = "".join(p.text for p in pieces), pieces[-1]
        usage = usage_of(last)
        k = self.request.num_logprobs
        logprobs = None if k is None else tuple(t for p in pieces for t in p.logprobs)
        if self.kind == "chat":
            message = ChatCompletionMessage(role="assistant", content=text)
            choice = ChatChoice(index=0, message=message, finish_reason=last.finish_reason,
                                logprobs=None if logprobs is None else chat_logprobs(logprobs, k))
            return ChatCompletion(id=self.id, object="chat.completion", created=self.created, model=self.model,
                                  choices=[choice], usage=usage)
        choice = CompletionChoice(index=0, text=text, finish_reason=last.finish_reason,
                                  logprobs=None if logprobs is None else completion_logprobs(logprobs, k))
        return Completion(id=self.id, object="text_completion", created=self.created, model=self.model,
                          choices=[choice], usage=usage)

    # -- server-sent events

    async def events(self) -> AsyncIterator[str]:
        """The SSE lines of the stream; the Triton request is cancelled if the client goes away."""
        try:
            # NOTE: the role chunk goes out in one write with the first token's: one send, one wake-up of the
            # client, before its first token.
            role = self._event(delta=ChoiceDelta(role="assistant", content=""), so_far=self._so_far(self.first, 0)) \
                if self.kind == "chat" else ""
            piece = self.first
            while True:
                if piece.num_tokens or piece.text:
                    # NOTE: OpenAI's chunks carry no token ids, so clients (the Locust user, benchmark tools) count
                    # one token per chunk, as they would from OpenAI: a response of several tokens is its text and
                    # an empty chunk for each further token, in one write.
                    yield role + self._content_chunks(piece)
                    role = ""
                if piece.finish_reason:
                    break
                piece = await self.generation.__anext__()
            yield role + self._event(finish_reason=piece.finish_reason, so_far=self._so_far(piece, piece.num_tokens))
            if self.request.include_usage:
                yield self._event(usage=usage_of(piece))
        except APIError as exc:
            yield f"data: {json.dumps(exc.body(), separators=(',', ':'))}\n\n"
        finally:
            await self.generation.aclose()
        yield DONE

    def _content_chunks(self, piece: Piece) -> str:
        """One content chunk per token of ``piece``: its text in the first, each token's log-probabilities and the
        counts so far in its own when the request asks for them."""
        if self.request.num_logprobs is None and not self.request.continuous_usage:
            return self._content(piece.text) + self._content("") * (piece.num_tokens - 1)
        logprobs = piece.logprobs if self.request.num_logprobs is not None else None
        return "".join(self._event(text=piece.text if i == 0 else "",
                                   so_far=self._so_far(piece, min(i + 1, piece.num_tokens)),
                                   logprobs=None if logprobs is None else logprobs[i:i + 1])
                       for i in range(max(piece.num_tokens, 1)))

    def _so_far(self, piece: Piece, num_sent: int) -> CompletionUsage | None:
        """The counts once ``num_sent`` of ``piece``'s tokens are out, for a request that asks for them in every
        chunk (the models send their counts in every response then)."""
        if not self.request.continuous_usage:
            return None
        done = piece.num_output_tokens - piece.num_tokens + num_sent
        return CompletionUsage(prompt_tokens=piece.num_input_tokens, completion_tokens=done,
                               total_tokens=piece.num_input_tokens + done)

    def _content(self, text: str) -> str:
        """The SSE line of a content chunk: the line :meth:`_event` renders for ``text``, byte for byte, from the
        empty content chunk rendered once per answer (a pydantic model and its dump per token were a tenth of the
        frontend's time per token). JSON escapes a string alike whoever writes it, pydantic or ``json``."""
        if self._content_parts is None:
            line = self._event(text="")
            slot = '"content":""' if self.kind == "chat" else '"text":""'
            before, found, after = line.partition(slot)
            if not found:
                raise RuntimeError(f"no {slot} in {line!r}")
            self._content_parts = (before + slot[:-2], after)
        before, after = self._content_parts
        return before + json.dumps(text, ensure_ascii=False) + after

    def _event(self, text: str = "", delta: ChoiceDelta | None = None, finish_reason: str | None = None,
               usage: CompletionUsage | None = None, logprobs: tuple[TokenLogprob, ...] | None = None,
               so_far: CompletionUsage | None = None) -> str:
        """One chunk: a choice's, carrying ``so_far`` as its usage (continuous usage), or the usage chunk."""
        extra = {"usage": usage or so_far} if self.request.include_usage else {}
        k = self.request.num_logprobs
        if usage is not None:
            choices = []
        elif self.kind == "chat":
            delta = delta or (ChoiceDelta() if finish_reason else ChoiceDelta(content=text))
            choices = [ChunkChoice(index=0, delta=delta, finish_reason=finish_reason,
                                   logprobs=None if logprobs is None else chat_logprobs(logprobs, k, chunk=True))]
        else:
            if logprobs is not None:
                found = completion_logprobs(logprobs, k, self._text_offset)
                self._text_offset += sum(len(t.token) for t in logprobs)
            choices = [CompletionChunkChoice(index=0, text=text, finish_reason=finish_reason,
                                             logprobs=None if logprobs is None else found)]
        if self.kind == "chat":
            chunk = ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                        model=self.model, choices=choices, **extra)
        else:
            chunk = CompletionChunk(id=self.id, object="text_completion", created=self.created, model=self.model,
                                    choices=choices, **extra)
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def usage_of(last: Piece) -> CompletionUsage:
    """Token counts as the model counted them (its final response)."""
    return CompletionUsage(prompt_tokens=last.num_input_tokens, completion_tokens=last.num_output_tokens,
                           total_tokens=last.num_input_tokens + last.num_output_tokens)

