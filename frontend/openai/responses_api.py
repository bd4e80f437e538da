"""OpenAI's Responses API (``POST /v1/responses``): text in, text out, nothing stored.

A request's ``input`` (a string, or message items of text) and ``instructions`` (a system turn placed first) become
chat messages, rendered with the model's chat template as chat completions renders them. What the Responses API
adds beyond that and the engine cannot honour (``previous_response_id``, ``conversation``, ``background``,
``reasoning``, ``include``, ``prompt``, tools, input items other than text messages, ``store: true``) is a 400
naming the parameter; chat's sampling parameters and vLLM's extras (``extra_body``) ride along as they do for chat.
``text.format`` asks for the structured output that chat's ``response_format`` asks for.

The answer is the ``openai`` package's own ``Response``: one ``message`` of one ``output_text``; ``status``
``incomplete`` (``incomplete_details.reason: max_output_tokens``) when the answer was cut by its length. Streamed,
it is OpenAI's server-sent events, each ``event: <type>`` and ``data: <json>`` with its ``sequence_number``:
``response.created``, ``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``, a
``response.output_text.delta`` per token (a Triton response of several tokens is its text and an empty delta for
each further token, as chat's chunks are), ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, and ``response.completed`` or ``response.incomplete``. An error after the first token
is an ``error`` event, which ends the stream; one before it is an HTTP error.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator, ClassVar, Literal

from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseErrorEvent,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseTextConfig,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from openai.types.responses.response import IncompleteDetails
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from pydantic import BaseModel, Field, field_validator

from frontend.openai.chat_template import ChatTemplate
from frontend.openai.protocol import APIError, ChatMessage, RequestModel, SamplingRequest, _same, bad_request
from frontend.openai.serving import every_piece, send
from frontend.openai.triton_bridge import Piece, TritonBridge, TritonGeneration

# The Responses API's parameters (and the SamplingRequest fields it has no use for) that this server honours at
# these values only (None: not sent), each with why.
RESPONSES_NEUTRAL_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((None,), "it stores no responses: send the whole conversation in input"),
    "conversation": ((None,), "it stores no conversations: send the whole conversation in input"),
    "store": ((None, False), "it stores no responses; every response says store: false"),
    "background": ((None, False), "it answers while the client waits"),
    "reasoning": ((None,), "the models have no reasoning settings"),
    "include": ((None, []), "it has nothing to add to a response"),
    "prompt": ((None,), "it stores no prompts"),
    "tools": ((None, []), "the Responses route calls no tools"),
    "tool_choice": ((None, "none", "auto"), "the Responses route calls no tools"),  # auto: none to call
    "max_tool_calls": ((None,), "the Responses route calls no tools"),
    "truncation": ((None, "disabled"), "it drops no input: an input beyond the context is a 400"),
    "top_logprobs": ((None, 0), "the Responses route returns no log-probabilities"),
    "context_management": ((None, []), "it compacts no context"),
    "moderation": ((None,), "it moderates nothing"),
    "max_tokens": ((None,), "the Responses API's name for it is max_output_tokens"),
    "n": ((None, 1), "a response has one answer"),
}


# ---- the request ------------------------------------------------------------------------------------------------


class InputText(RequestModel):
    type: Literal["input_text"]
    text: str


class OutputText(RequestModel):
    """An earlier answer's text, sent back as an assistant turn (as the SDK dumps a response's output)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(RequestModel):
    """A message item: ``{"role", "content"}``, with or without ``"type": "message"``; an earlier response's output
    message (with its ``id`` and ``status``) is one too."""

    type: str = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Annotated[InputText | OutputText, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    @field_validator("type")
    @classmethod
    def _a_message(cls, kind: str) -> str:
        if kind != "message":
            raise ValueError(f"input items of type {kind!r} are not supported by this server; send messages of text")
        return kind

    def chat_message(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return ChatMessage(role=self.role, content=text)


class PlainText(RequestModel):
    type: Literal["text"]


class JsonObject(RequestModel):
    type: Literal["json_object"]


class JsonSchema(RequestModel):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    format: Annotated[PlainText | JsonObject | JsonSchema, Field(discriminator="type")] | None = None
    verbosity: str | None = None


class StreamOptions(RequestModel):
    include_obfuscation: bool | None = None  # a hint: OpenAI pads its deltas against side channels; none here


class ResponsesRequest(SamplingRequest):
    """``POST /v1/responses``."""

    PROMPT_PARAM: ClassVar[str] = "input"
    MAX_TOKENS_PARAMS: ClassVar[tuple[str, ...]] = ("max_output_tokens",)

    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    text: TextConfig | None = None
    stream_options: StreamOptions | None = None
    parallel_tool_calls: bool | None = None  # says nothing without tools
    # What only labels the request or tunes OpenAI's caches (nothing to honour).
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # Honoured only at their neutral value (RESPONSES_NEUTRAL_VALUES above).
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tool_calls: int | None = None
    truncation: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    context_management: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None

    def check_supported(self) -> None:
        """A 400 naming the first parameter this server cannot honour: the Responses API's own, then chat's."""
        for name, (neutral, why) in RESPONSES_NEUTRAL_VALUES.items():
            value = getattr(self, name)
            if not any(_same(value, ok) for ok in neutral):
                raise bad_request(f"{name}={value!r} is not supported by this server ({why}); leave it out",
                                  param=name, code="unsupported_parameter")
        if self.text is not None and self.text.verbosity is not None:
            raise bad_request("text.verbosity is not supported by this server (the models have no verbosity "
                              "setting); leave it out", param="text.verbosity", code="unsupported_parameter")
        if self.input == []:
            raise bad_request("input is empty: send a string or at least one message", param="input")
        super().check_supported()
        self.structured_output()  # one at most

    def messages(self) -> list[ChatMessage]:
        """The chat turns: ``instructions`` as the system turn first, then ``input`` (a string: one user turn)."""
        turns = [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return [*turns, ChatMessage(role="user", content=self.input)]
        return [*turns, *(item.chat_message() for item in self.input)]

    def structured_output(self) -> dict[str, Any] | None:
        """``text.format`` as chat's ``response_format`` maps it, or one of vLLM's structured-output fields."""
        fmt = self.text.format if self.text is not None else None
        vllms = super().structured_output()
        if fmt is None or fmt.type == "text":
            return vllms
        if vllms is not None:
            raise bad_request("send text.format or one of vLLM's structured-output fields, not both: each asks for "
                              "a structured output", param="text.format")
        if fmt.type == "json_object":
            return {"json_object": True}
        return {"json": fmt.schema_ or {"type": "object"}}

    @property
    def include_usage(self) -> bool:
        return False  # the last event's response carries the usage

    def text_config(self) -> ResponseTextConfig:
        """What the response says of ``text``: its format, plain text unless the request asked for another."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else PlainText(type="text")
        return ResponseTextConfig.model_validate({"format": fmt.model_dump(by_alias=True, exclude_none=True)})


def render(template: ChatTemplate, request: ResponsesRequest) -> str:
    """The prompt for ``request``'s messages; the template's refusal names ``input``, what the client sent."""
    try:
        return template.render(request.messages())
    except APIError as exc:
        exc.param = ResponsesRequest.PROMPT_PARAM
        raise


# ---- the answer -------------------------------------------------------------------------------------------------


@dataclass
class ResponseAnswer:
    """One generation in progress, answered as a ``Response`` or as its stream of events."""

    request: ResponsesRequest
    generation: TritonGeneration
    first: Piece
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    _sequence_number: int = field(default=0, init=False, repr=False)
    _delta_parts: tuple[str, str, str] | None = field(default=None, init=False, repr=False)

    @classmethod
    async def start(cls, bridge: TritonBridge, kind: str, model: str, request: ResponsesRequest,
                    prompt: str) -> "ResponseAnswer":
        """Send the request and wait for its first response (``Answer.start``'s contract; ``kind`` is unused)."""
        return cls(request, *await send(bridge, model, request, prompt))

    # -- one JSON answer

    async def whole(self) -> Response:
        pieces = await every_piece(self.first, self.generation)
        return self.response("".join(p.text for p in pieces), pieces[-1])

    def response(self, text: str, last: Piece) -> Response:
        """The finished response: ``text`` in one message, the usage as the model counted it (``last``)."""
        status = "incomplete" if last.finish_reason == "length" else "completed"
        usage = ResponseUsage(
            input_tokens=last.num_input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
            output_tokens=last.num_output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
            total_tokens=last.num_input_tokens + last.num_output_tokens,
        )
        return self._response(status, [self._message(status, [self._text(text)])], usage)

    def _response(self, status: str, output: list[ResponseOutputMessage],
                  usage: ResponseUsage | None = None) -> Response:
        request = self.request
        incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return Response(
            id=self.id, object="response", created_at=self.created_at, model=request.model, status=status,
            output=output, usage=usage, error=None, incomplete_details=incomplete,
            instructions=request.instructions, metadata=request.metadata,
            max_output_tokens=request.max_output_tokens, temperature=request.temperature, top_p=request.top_p,
            user=request.user, text=request.text_config(), truncation="disabled", previous_response_id=None,
            background=False, tools=[], tool_choice=request.tool_choice or "auto",
            parallel_tool_calls=True if request.parallel_tool_calls is None else request.parallel_tool_calls,
            store=False,  # NOTE: not a field of the SDK's type, which keeps it: OpenAI's responses carry it
        )

    def _message(self, status: str, content: list[ResponseOutputText]) -> ResponseOutputMessage:
        return ResponseOutputMessage(id=self.message_id, type="message", role="assistant", status=status,
                                     content=content)

    @staticmethod
    def _text(text: str) -> ResponseOutputText:
        return ResponseOutputText(type="output_text", text=text, annotations=[], logprobs=[])

    # -- server-sent events

    async def events(self) -> AsyncIterator[str]:
        """The stream's events; the Triton request is stopped if the client goes away."""
        try:
            # NOTE: the opening events go out in one write with the first token's delta: one send, one wake-up of
            # the client, before its first token.
            opening = self._opening()
            piece, texts = self.first, []
            while True:
                texts.append(piece.text)
                if piece.num_tokens or piece.text:
                    yield opening + "".join(self._delta(piece.text if i == 0 else "")
                                            for i in range(max(piece.num_tokens, 1)))
                    opening = ""
                if self.generation.finished:
                    break
                piece = await self.generation.__anext__()
            yield opening + self._closing("".join(texts), piece)
        except APIError as exc:
            yield self._event(ResponseErrorEvent(type="error", code=exc.code, message=exc.message, param=exc.param,
                                                 sequence_number=self._next()))
        finally:
            await self.generation.aclose()

    def _opening(self) -> str:
        started = self._response("in_progress", [])
        part = dict(item_id=self.message_id, output_index=0, content_index=0)
        return "".join(self._event(event) for event in (
            ResponseCreatedEvent(type="response.created", response=started, sequence_number=self._next()),
            ResponseInProgressEvent(type="response.in_progress", response=started, sequence_number=self._next()),
            ResponseOutputItemAddedEvent(type="response.output_item.added", output_index=0,
                                         item=self._message("in_progress", []), sequence_number=self._next()),
            ResponseContentPartAddedEvent(type="response.content_part.added", part=self._text(""), **part,
                                          sequence_number=self._next()),
        ))

    def _closing(self, text: str, last: Piece) -> str:
        done = self.response(text, last)
        (message,) = done.output
        part = dict(item_id=self.message_id, output_index=0, content_index=0)
        final = ResponseIncompleteEvent if done.status == "incomplete" else ResponseCompletedEvent
        return "".join(self._event(event) for event in (
            ResponseTextDoneEvent(type="response.output_text.done", text=text, logprobs=[], **part,
                                  sequence_number=self._next()),
            ResponseContentPartDoneEvent(type="response.content_part.done", part=self._text(text), **part,
                                         sequence_number=self._next()),
            ResponseOutputItemDoneEvent(type="response.output_item.done", output_index=0, item=message,
                                        sequence_number=self._next()),
            final(type=f"response.{done.status}", response=done, sequence_number=self._next()),
        ))

    def _delta(self, text: str) -> str:
        """A ``response.output_text.delta`` event, byte for byte what :meth:`_event` renders, from the empty delta
        rendered once (as serving.py's chat chunks: a pydantic model and its dump per token cost the frontend a
        tenth of its time per token)."""
        if self._delta_parts is None:
            line = self._event(ResponseTextDeltaEvent(type="response.output_text.delta", item_id=self.message_id,
                                                      output_index=0, content_index=0, delta="", logprobs=[],
                                                      sequence_number=0))
            head, found, rest = line.partition('"delta":""')
            middle, numbered, tail = rest.partition('"sequence_number":0')
            if not (found and numbered):
                raise RuntimeError(f"no empty delta or sequence number in {line!r}")
            self._delta_parts = (head + '"delta":', middle + '"sequence_number":', tail)
        head, middle, tail = self._delta_parts
        return head + json.dumps(text, ensure_ascii=False) + middle + str(self._next()) + tail

    def _next(self) -> int:
        self._sequence_number += 1
        return self._sequence_number - 1

    @staticmethod
    def _event(event: BaseModel) -> str:
        return f"event: {event.type}\ndata: {event.model_dump_json(exclude_unset=True, by_alias=True)}\n\n"
