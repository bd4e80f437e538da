"""The OpenAI answers for completions and chat: one JSON response, or server-sent events as OpenAI streams them.

A stream is: (chat) a role chunk, one content chunk per token (a Triton response that carries several tokens, sent
every ``stream_interval`` steps, becomes its text in one chunk and an empty chunk for each further token; each with
its token's log-probabilities when asked), a chunk with the ``finish_reason`` and an empty delta, the usage chunk
when ``stream_options.include_usage`` asks (then every other chunk carries ``"usage": null``, or the counts so far
with vLLM's ``continuous_usage_stats``), and ``data: [DONE]``. An error after the first token is sent as
``data: {"error": ...}`` before ``[DONE]``; one before it is an HTTP error (the first Triton response is awaited
before the stream starts, so a refused request gets its status). A chat answer that may call tools (tools.py) is
parsed once whole: its stream holds the text and sends the answer, tool calls or content, in one delta before the
finish chunk.

With ``n`` > 1 the n choices are the models' n sequences, each response carrying its ``index``: streamed, each
choice's chunks as they are made (a role chunk for every choice first, in chat) and its own finish chunk; whole, the
choices in index order. Usage counts the prompt once and the tokens of all n completions, as OpenAI does.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Literal

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from frontend.openai.logprobs import TokenLogprob, chat_logprobs, completion_logprobs, echo_logprobs
from frontend.openai.protocol import APIError, SamplingRequest
from frontend.openai.tools import Reply
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
    echo: str = ""  # the prompt, when a completion repeats it before its text
    _content_parts: dict[int, tuple[str, str]] = field(default_factory=dict, init=False, repr=False)  # by index
    # completions' logprobs: the text streamed so far, by index
    _text_offsets: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    async def start(cls, bridge: TritonBridge, kind, model: str, request: SamplingRequest, prompt: str) -> "Answer":
        """Send the request and wait for its first response: an error before any token raises :class:`APIError`."""
        generation, first = await send(bridge, model, request, prompt)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return cls(kind, model, request, generation, first, f"{prefix}-{uuid.uuid4().hex}", int(time.time()),
                   request.echoed(prompt))

    # -- one JSON answer

    async def whole(self) -> ChatCompletion | Completion:
        """The whole answer (the models send it in one response when ``stream`` is false)."""
        pieces = await every_piece(self.first, self.generation)
        by_index: dict[int, list[Piece]] = {}
        for piece in pieces:
            by_index.setdefault(piece.index, []).append(piece)
        k = self.request.num_logprobs
        answers = [(self.echo + "".join(p.text for p in ps), ps[-1],
                    None if k is None else tuple(t for p in ps for t in p.logprobs))
                   for _, ps in sorted(by_index.items())]
        usage = usage_of([last for _, last, _ in answers])
        if self.kind == "chat":
            replies = [self._reply(text, last.finish_reason) for text, last, _ in answers]
            choices = [ChatChoice(index=last.index, message=reply.message(), finish_reason=reply.finish_reason,
                                  logprobs=None if logprobs is None else chat_logprobs(logprobs, k))
                       for (_, last, logprobs), reply in zip(answers, replies)]
            return ChatCompletion(id=self.id, object="chat.completion", created=self.created, model=self.model,
                                  choices=choices, usage=usage)
        # NOTE: the prompt's log-probabilities come in the request's first response sent, whichever sequence's it is
        prompt = next((p.prompt_logprobs for p in pieces if p.prompt_logprobs is not None), None)
        echoed = echo_logprobs(self.echo, prompt or []) if self.echo else ()
        vllms = {} if self.request.prompt_logprobs is None else {"prompt_logprobs": prompt}
        choices = [CompletionChoice(index=last.index, text=text, finish_reason=last.finish_reason,
                                    logprobs=None if logprobs is None else
                                    completion_logprobs(logprobs, k, len(self.echo), echoed), **vllms)
                   for text, last, logprobs in answers]
        return Completion(id=self.id, object="text_completion", created=self.created, model=self.model,
                          choices=choices, usage=usage)

    # -- server-sent events

    async def events(self) -> AsyncIterator[str]:
        """The SSE lines of the stream; the Triton request is cancelled if the client goes away."""
        try:
            # NOTE: the role chunk goes out in one write with the first token's: one send, one wake-up of the
            # client, before its first token.
            role = "".join(self._event(delta=ChoiceDelta(role="assistant", content=""), index=i,
                                       so_far=self._so_far(self.first, 0))
                           for i in range(self.generation.n)) if self.kind == "chat" else ""
            if self.echo:  # the prompt first, in a chunk of its own for every choice
                role = "".join(self._echo(i) for i in range(self.generation.n))
            piece, ended = self.first, []
            # NOTE: a tool-calling answer is parsed once whole, so its text is held and sent in one delta at its end.
            calling, held = self.request.tool_calling, {}
            while True:
                if calling is not None:
                    held[piece.index] = held.get(piece.index, "") + piece.text
                elif piece.num_tokens or piece.text:
                    # NOTE: OpenAI's chunks carry no token ids, so clients (the Locust user, benchmark tools) count
                    # one token per chunk, as they would from OpenAI: a response of several tokens is its text and
                    # an empty chunk for each further token, in one write.
                    yield role + self._content_chunks(piece)
                    role = ""
                if piece.finish_reason:
                    finish_reason = piece.finish_reason
                    if calling is not None:
                        reply = calling.reply(held.pop(piece.index, ""), finish_reason)
                        role += self._event(delta=reply.delta(), index=piece.index,
                                            so_far=self._so_far(piece, piece.num_tokens))
                        finish_reason = reply.finish_reason
                    yield role + self._event(finish_reason=finish_reason, index=piece.index,
                                             so_far=self._so_far(piece, piece.num_tokens))
                    role = ""
                    ended.append(piece)
                if self.generation.finished:
                    break
                piece = await self.generation.__anext__()
            if self.request.include_usage:
                yield self._event(usage=usage_of(ended))
        except APIError as exc:
            yield f"data: {json.dumps(exc.body(), separators=(',', ':'))}\n\n"
        finally:
            await self.generation.aclose()
        yield DONE

    def _reply(self, text: str, finish_reason: str) -> Reply:
        """A chat answer as the client gets it: parsed into tool calls when the request offers tools."""
        calling = self.request.tool_calling
        return Reply(text, (), finish_reason) if calling is None else calling.reply(text, finish_reason)

    def _echo(self, index: int) -> str:
        """The chunk of an echoed prompt, with its tokens' log-probabilities when the request asks (they come in the
        first response); the generated text's offsets start after it."""
        if self.request.num_logprobs is None:
            return self._content(self.echo, index)
        line = self._event(text=self.echo, index=index,
                           logprobs=echo_logprobs(self.echo, self.first.prompt_logprobs or []))
        self._text_offsets[index] = len(self.echo)
        return line

    def _content_chunks(self, piece: Piece) -> str:
        """One content chunk per token of ``piece``: its text in the first, each token's log-probabilities and the
        counts so far in its own when the request asks for them."""
        if self.request.num_logprobs is None and not self.request.continuous_usage:
            return self._content(piece.text, piece.index) + self._content("", piece.index) * (piece.num_tokens - 1)
        logprobs = piece.logprobs if self.request.num_logprobs is not None else None
        return "".join(self._event(text=piece.text if i == 0 else "", index=piece.index,
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

    def _content(self, text: str, index: int = 0) -> str:
        """The SSE line of a content chunk: the line :meth:`_event` renders for ``text``, byte for byte, from the
        empty content chunk rendered once per choice (a pydantic model and its dump per token were a tenth of the
        frontend's time per token). JSON escapes a string alike whoever writes it, pydantic or ``json``."""
        parts = self._content_parts.get(index)
        if parts is None:
            line = self._event(text="", index=index)
            slot = '"content":""' if self.kind == "chat" else '"text":""'
            before, found, after = line.partition(slot)
            if not found:
                raise RuntimeError(f"no {slot} in {line!r}")
            parts = self._content_parts[index] = (before + slot[:-2], after)
        before, after = parts
        return before + json.dumps(text, ensure_ascii=False) + after

    def _event(self, text: str = "", delta: ChoiceDelta | None = None, finish_reason: str | None = None,
               usage: CompletionUsage | None = None, logprobs: tuple[TokenLogprob, ...] | None = None,
               so_far: CompletionUsage | None = None, index: int = 0) -> str:
        """One chunk: a choice's, carrying ``so_far`` as its usage (continuous usage), or the usage chunk."""
        extra = {"usage": usage or so_far} if self.request.include_usage else {}
        k = self.request.num_logprobs
        if usage is not None:
            choices = []
        elif self.kind == "chat":
            delta = delta or (ChoiceDelta() if finish_reason else ChoiceDelta(content=text))
            choices = [ChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                                   logprobs=None if logprobs is None else chat_logprobs(logprobs, k, chunk=True))]
        else:
            if logprobs is not None:
                offset = self._text_offsets.get(index, 0)
                found = completion_logprobs(logprobs, k, offset)
                self._text_offsets[index] = offset + sum(len(t.token) for t in logprobs)
            choices = [CompletionChunkChoice(index=index, text=text, finish_reason=finish_reason,
                                             logprobs=None if logprobs is None else found)]
        if self.kind == "chat":
            chunk = ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                        model=self.model, choices=choices, **extra)
        else:
            chunk = CompletionChunk(id=self.id, object="text_completion", created=self.created, model=self.model,
                                    choices=choices, **extra)
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


async def send(bridge: TritonBridge, model: str, request: SamplingRequest,
               prompt: str) -> tuple[TritonGeneration, Piece]:
    """Send ``request`` for ``prompt`` to ``model`` and wait for its first response; an error before any token raises
    :class:`APIError`, the generation closed."""
    generation = await bridge.generate(model, request.generation_request(prompt), request.PROMPT_PARAM)
    try:
        return generation, await generation.__anext__()
    except BaseException:
        await generation.aclose()
        raise


async def every_piece(first: Piece, generation: TritonGeneration) -> list[Piece]:
    """``first`` and the rest of ``generation``'s responses; the generation closed after, whatever happened."""
    pieces = [first]
    try:
        async for piece in generation:
            pieces.append(piece)
    finally:
        await generation.aclose()
    return pieces


def usage_of(lasts: list[Piece]) -> CompletionUsage:
    """Token counts as the model counted them (each sequence's last response): the prompt once, every completion's
    tokens."""
    prompt_tokens = lasts[-1].num_input_tokens if lasts else 0
    completion_tokens = sum(last.num_output_tokens for last in lasts)
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)

