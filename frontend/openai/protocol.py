"""What an OpenAI request may carry, what the engine cannot honour, and how the rest maps onto the models' inputs.

Requests are pydantic models that refuse unknown fields (OpenAI answers "Unrecognized request argument supplied");
parameters OpenAI defines but the engine cannot honour are accepted only at their neutral value (``n: 1``,
``presence_penalty: 0``, ``logprobs: false``, ...), anything else is a 400 naming the parameter. vLLM's extra
sampling parameters (``top_k``, ``min_tokens``, ``ignore_eos``) ride along, as the ``openai`` SDK's ``extra_body``
sends them. Responses are the ``openai`` package's own types (serving.py).
"""

from __future__ import annotations

from typing import Any, Literal

from openai.types.shared import ErrorObject
from pydantic import BaseModel, ConfigDict, Field

from backend.contract.priority import level_of_openai
from client.schema import GenerationRequest

MAX_SEED = 2**64 - 1  # the models' seed input is UINT64


# ---- errors -----------------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered in OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, with its status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        error = ErrorObject(message=self.message, type=self.type, param=self.param, code=self.code)
        return {"error": error.model_dump(exclude_unset=True)}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# ---- requests ---------------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


# OpenAI parameter -> the values that ask for nothing the engine lacks (None: not sent).
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, False, True),  # says nothing without tools
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "store": (None, False),
}


class SamplingRequest(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # What only identifies or labels the request (nothing to honour).
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    # vLLM's: a lower value is served earlier, 0 by default; sent as Triton's level (level_of_openai).
    priority: int = 0
    # OpenAI's, honoured only at their neutral value (NEUTRAL_VALUES).
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def check_supported(self) -> None:
        """A 400 naming the first parameter the engine cannot honour."""
        for name, neutral in NEUTRAL_VALUES.items():
            value = getattr(self, name, None)
            if not any(_same(value, ok) for ok in neutral):
                raise bad_request(
                    f"{name}={value!r} is not supported by this server (the engine has no {name}); "
                    f"leave it out{_neutral_hint(neutral)}",
                    param=name,
                    code="unsupported_parameter",
                )
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        limit = self.requested_max_tokens
        if limit is not None and self.min_tokens > limit:
            raise bad_request(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({limit})", param="min_tokens")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    def generation_request(self, prompt: str) -> GenerationRequest:
        """The models' inputs for ``prompt`` (model_repository/README.md's schema)."""
        max_tokens = self.requested_max_tokens
        return GenerationRequest(
            prompt,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or None,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=None if self.top_k is None else max(self.top_k, 0),
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or ()),
            ignore_eos=self.ignore_eos or None,
            stream=bool(self.stream),
            priority=level_of_openai(self.priority),
            # NOTE: no max_tokens means "until the context is full" (as OpenAI's chat and vLLM), which the models'
            # max_tokens input cannot say: its default is 16. A null in sampling_parameters can.
            sampling_parameters={"max_tokens": None} if max_tokens is None else None,
        )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def _same(value: Any, neutral: Any) -> bool:
    """Equal, and a bool only to a bool (``logprobs: true`` is not ``1``)."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def _neutral_hint(neutral: tuple[Any, ...]) -> str:
    shown = [repr(v) for v in neutral if v is not None and v != [] and v != {}]
    return f" or send {' or '.join(shown)}" if shown else ""


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text."""

    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's and vLLM's default for completions
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None

    def prompt_text(self) -> str:
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if len(prompts) != 1:
            raise bad_request(
                f"prompt must be one string; got a list of {len(prompts)} (send one request per prompt)",
                param="prompt",
            )
        if not prompts[0]:
            raise bad_request("prompt is empty", param="prompt")
        return prompts[0]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A system, developer, user or assistant turn; content as text or text parts."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise bad_request(
                    "send max_completion_tokens or max_tokens (its deprecated name), not both with different values",
                    param="max_completion_tokens",
                )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
