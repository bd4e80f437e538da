"""What an OpenAI request may carry, what the engine cannot honour, and how the rest maps onto the models' inputs.

Requests are pydantic models that refuse unknown fields (OpenAI answers "Unrecognized request argument supplied");
parameters OpenAI or vLLM define but the engine cannot honour are accepted only at their neutral value (``n: 1``,
``use_beam_search: false``, ...), anything else is a 400 naming the parameter. vLLM's extra sampling parameters
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ...) ride along,
as the ``openai`` SDK's ``extra_body`` sends them; docs/clients.md lists what is honoured, what is accepted and
ignored (hints), and what is refused. Responses are the ``openai`` package's own types (serving.py).
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from openai.types.shared import ErrorObject
from pydantic import BaseModel, ConfigDict, Field, model_validator

from backend.contract.priority import level_of_openai
from backend.contract.sampling_ranges import SAMPLING_RANGES
from client.schema import GenerationRequest

if TYPE_CHECKING:
    from frontend.openai.tools import ToolCalling



def _ranged(name: str, default: Any = None) -> Any:
    """A sampling field with the engine's range for ``name`` (backend/contract/sampling_ranges.py): one table of
    bounds for both, so a value this accepts is never refused by the engine for its range."""
    return Field(default, **SAMPLING_RANGES[name].bounds)


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


class RequestModel(BaseModel):
    """A request body, or a part of one: a field this server does not know is refused (a 400 naming it), never
    ignored."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the counts so far in every chunk


# OpenAI's or vLLM's parameter -> the values that ask for nothing the engine lacks (None: not sent).
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    # vLLM's extras (its "Extra Parameters" of the OpenAI-compatible server).
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),  # beam search only
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False),
    "logits_processors": (None, []),
    "guided_whitespace_pattern": (None,),
    "add_generation_prompt": (None, True),  # chat: the template's assistant prompt, always added
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    # SGLang's, which vLLM's and SGLang's routers write into every request they forward, at these values.
    "return_hidden_states": (None, False),
}


class SamplingRequest(RequestModel):
    """The fields completions and chat share."""

    model: str
    max_tokens: int | None = _ranged("max_tokens")
    temperature: float | None = _ranged("temperature")
    top_p: float | None = _ranged("top_p")
    # NOTE: from 0, not the engine's -2**63: the seed travels in the models' UINT64 input (client/schema.py).
    seed: int | None = Field(None, ge=0, le=SAMPLING_RANGES["seed"].hi)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # What only identifies or labels the request (nothing to honour).
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    presence_penalty: float | None = _ranged("presence_penalty")
    frequency_penalty: float | None = _ranged("frequency_penalty")
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> -100 to 100; the engine checks them
    # vLLM's extra sampling parameters.
    top_k: int | None = _ranged("top_k")  # -1 or 0: off
    min_p: float | None = _ranged("min_p")
    repetition_penalty: float | None = _ranged("repetition_penalty")
    min_tokens: int = _ranged("min_tokens", 0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured output (backend/engine/structured_output.py): vLLM's structured_outputs, and the guided_* names that
    # vLLM had before it and that tools still send; chat's response_format maps onto the same.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's hints, accepted and ignored: nothing in the answer depends on them.
    cache_salt: str | None = None  # salts vLLM's prefix cache between tenants
    guided_decoding_backend: str | None = None  # which grammar library; this server has one (llguidance)
    # SGLang's name for include_stop_str_in_output: vLLM's and SGLang's routers send it (false) in every request.
    no_stop_trim: bool = False
    # vLLM's: a lower value is served earlier, 0 by default; sent as Triton's level (level_of_openai).
    priority: int = 0
    n: int | None = _ranged("n")  # answers of the prompt (the models' n, up to their limit)
    # OpenAI's and vLLM's, honoured only at their neutral value (NEUTRAL_VALUES).
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    logits_processors: list[Any] | None = None
    guided_whitespace_pattern: str | None = None
    return_hidden_states: bool | None = None

    # Parameters of NEUTRAL_VALUES that this kind of request honours at any value.
    HONOURED: ClassVar[frozenset[str]] = frozenset()
    PROMPT_PARAM: ClassVar[str] = "prompt"  # what carries the prompt here (errors about the prompt name it)
    # What may carry the output limit here, the current name first (errors name the one the client sent).
    MAX_TOKENS_PARAMS: ClassVar[tuple[str, ...]] = ("max_tokens",)

    def check_supported(self) -> None:
        """A 400 naming the first parameter the engine cannot honour."""
        for name, neutral in NEUTRAL_VALUES.items():
            if name in self.HONOURED:
                continue
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

    @property
    def continuous_usage(self) -> bool:
        """The counts so far in every chunk (vLLM's ``continuous_usage_stats``, which needs ``include_usage``)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def num_logprobs(self) -> int | None:
        """The likeliest tokens to return beside each sampled one's log-probability; None: no log-probabilities."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The likeliest tokens to return beside each prompt token's log-probability (the models'
        ``prompt_logprobs``); None: the prompt's are not computed."""
        return None

    def structured_output(self) -> dict[str, Any] | None:
        """The one structured-output request among the fields that can carry one (vLLM's keys), or None."""
        sent = {name: value for name, value in (
            ("structured_outputs", self.structured_outputs),
            ("guided_json", None if self.guided_json is None else {"json": self.guided_json}),
            ("guided_regex", None if self.guided_regex is None else {"regex": self.guided_regex}),
            ("guided_choice", None if self.guided_choice is None else {"choice": self.guided_choice}),
            ("guided_grammar", None if self.guided_grammar is None else {"grammar": self.guided_grammar}),
            ("response_format", self.response_format_output()),
            ("tools", None if self.tool_calling is None else self.tool_calling.structured_output()),
        ) if value is not None}
        if len(sent) > 1:
            raise bad_request(f"send one of {', '.join(sent)}: each asks for a structured output",
                              param=next(iter(sent)))
        return next(iter(sent.values()), None)

    def response_format_output(self) -> dict[str, Any] | None:
        return None  # chat's response_format

    @property
    def tool_calling(self) -> ToolCalling | None:
        return None  # chat's tools

    def generation_request(self, prompt: str) -> GenerationRequest:
        """The models' inputs for ``prompt`` (model_repository/README.md's schema)."""
        max_tokens = self.requested_max_tokens
        # NOTE: no max_tokens means "until the context is full" (as OpenAI's chat and vLLM), which the models'
        # max_tokens input cannot say: its default is 16. A null in sampling_parameters can.
        sampling = {"max_tokens": None} if max_tokens is None else {}
        if self.num_logprobs is not None:
            sampling["logprobs"] = self.num_logprobs
        if self.num_prompt_logprobs is not None:
            sampling["prompt_logprobs"] = self.num_prompt_logprobs
        sampling.update(self._sampling_extras())
        structured = self.structured_output()
        if structured is not None:
            sampling["structured_outputs"] = structured
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
            n=self.n,
            stream=bool(self.stream),
            sampling_parameters=sampling or None,
            return_logprobs=True if self.num_logprobs is not None else None,
            return_num_input_tokens=True if self.continuous_usage else None,
            return_num_output_tokens=True if self.continuous_usage else None,
            priority=level_of_openai(self.priority),
        )

    def _sampling_extras(self) -> dict[str, Any]:
        """The settings that travel in ``sampling_parameters`` (vLLM's names), those sent and not at the engine's
        default only, so a plain request's inputs stay as they were."""
        sent = {
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "min_p": self.min_p,
            "logit_bias": self.logit_bias or None, "stop_token_ids": self.stop_token_ids or None,
            "include_stop_str_in_output": self.include_stop_str_in_output or self.no_stop_trim or None,
            "skip_special_tokens": None if self.skip_special_tokens else False,
        }
        return {name: value for name, value in sent.items() if value is not None}

    @property
    def requested_max_tokens(self) -> int | None:
        return getattr(self, self.max_tokens_param)

    @property
    def max_tokens_param(self) -> str:
        """The name under which the client sent its output limit (errors name it so): the first of
        ``MAX_TOKENS_PARAMS`` it sent, else the last of them."""
        sent = (name for name in self.MAX_TOKENS_PARAMS if getattr(self, name) is not None)
        return next(sent, self.MAX_TOKENS_PARAMS[-1])

    def echoed(self, prompt: str) -> str:
        """What the answer repeats of the prompt before the generated text (completions' ``echo``)."""
        return ""


def _same(value: Any, neutral: Any) -> bool:
    """Equal, and a bool only to a bool (``logprobs: true`` is not ``1``)."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def _neutral_hint(neutral: tuple[Any, ...]) -> str:
    shown = [repr(v) for v in neutral if v is not None and v != [] and v != {}]
    return f" or send {' or '.join(shown)}" if shown else ""


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text."""

    prompt: str | list[str]
    max_tokens: int | None = _ranged("max_tokens", 16)  # OpenAI's and vLLM's default for completions
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = _ranged("logprobs")
    # vLLM's: each choice carries the prompt's log-probabilities in vLLM's shape (``prompt_logprobs``)
    prompt_logprobs: int | None = _ranged("prompt_logprobs")

    HONOURED: ClassVar[frozenset[str]] = frozenset({"echo", "prompt_logprobs"})

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """vLLM's ``prompt_logprobs``, else, with ``echo``, ``logprobs``: the echoed prompt's tokens come with theirs
        (OpenAI's legacy completions)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs is returned in whole answers only: send stream: false (echo with "
                              "logprobs streams the prompt's log-probabilities in OpenAI's shape)",
                              param="prompt_logprobs", code="unsupported_parameter")

    def echoed(self, prompt: str) -> str:
        return prompt if self.echo else ""

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


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class MessageFunction(RequestModel):
    name: str
    arguments: str  # JSON text


class MessageToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: MessageFunction


class ChatMessage(RequestModel):
    """A system, developer, user, assistant or tool turn; content as text or text parts. An assistant turn may carry
    the tool calls it made (its content null), a tool turn the result of the call ``tool_call_id`` names."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only in an assistant turn with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant turns, not to {self.role!r} ones")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("a tool turn needs the tool_call_id of the call it answers (and only a tool turn has one)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    PROMPT_PARAM: ClassVar[str] = "messages"
    MAX_TOKENS_PARAMS: ClassVar[tuple[str, ...]] = ("max_completion_tokens", "max_tokens")  # max_tokens: deprecated

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = _ranged("max_tokens")
    logprobs: bool | None = None
    top_logprobs: int | None = _ranged("logprobs")
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
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
    # SGLang's reasoning switches, which the routers send in every chat request: hints, since the model has no
    # reasoning part to separate, stream or leave out.
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None

    def response_format_output(self) -> dict[str, Any] | None:
        """OpenAI's response_format as a structured output: ``json_object`` (any JSON object), ``json_schema`` (its
        ``json_schema.schema``), ``text`` (none)."""
        fmt = self.response_format
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"json_object": True}
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad_request("response_format.json_schema must be an object with the JSON schema in 'schema'",
                                  param="response_format")
            return {"json": spec.get("schema") or {"type": "object"}}
        raise bad_request(f"response_format type {fmt.get('type')!r} is not supported; send 'text', 'json_object' "
                          "or 'json_schema'", param="response_format")

    @cached_property
    def tool_calling(self) -> ToolCalling | None:
        """What tools and tool_choice ask of the answer; None when no tool may be called."""
        from frontend.openai.tools import ToolCalling  # NOTE: here: tools.py builds on this module's messages

        return ToolCalling.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.logprobs and self.tool_calling is not None:
            raise bad_request("logprobs cannot be combined with tool calls (the answer is parsed into them): leave "
                              "out logprobs, or send tool_choice: none", param="logprobs")
        self.structured_output()  # one at most, and a response_format this server knows
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise bad_request(
                    "send max_completion_tokens or max_tokens (its deprecated name), not both with different values",
                    param="max_completion_tokens",
                )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
