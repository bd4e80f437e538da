"""Per-request generation settings, named and meant as vLLM's ``SamplingParams``, validated by pydantic.

Each number's range is read from backend/contract/sampling_ranges.py, the table the OpenAI frontend states too;
numbers may arrive as strings (``"8"``, ``"0.5"``: genai-perf sends them so) and become their type, a bool is not a
number. A refusal is the contract's ``InvalidRequest`` (a ``ValueError``, backend/contract/errors.py) naming the
setting and what it may be, e.g. ``[invalid_request:top_p] top_p must be in (0, 1]; got 2.0``.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import ErrorDetails

from backend.contract.errors import InvalidRequest, refuse_unknown
from backend.contract.sampling_ranges import (
    MAX_LOGIT_BIAS_TOKENS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SAMPLING_RANGES,
)
from backend.engine.structured_output import StructuredOutputsParams


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number; got {value!r}")
    return value


Integer = Annotated[int, BeforeValidator(_not_a_bool)]
Number = Annotated[float, BeforeValidator(_not_a_bool), Field(allow_inf_nan=False)]
StructuredOutputs = Annotated[StructuredOutputsParams | None, PlainValidator(StructuredOutputsParams.from_value)]


def _ranged(name: str, default: Any) -> Any:
    """The field's default, and its range from the contract."""
    return Field(default, **SAMPLING_RANGES[name].bounds)


def _refusals_name_their_setting(cls: type) -> type:
    """Construction refuses with the contract's ``InvalidRequest`` (its ``[invalid_request:param]`` code, which the
    client reads), not with pydantic's ``ValidationError``."""
    validate = cls.__init__

    @functools.wraps(validate)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            validate(self, *args, **kwargs)
        except ValidationError as exc:
            raise _refusal(exc.errors()[0]) from None

    cls.__init__ = __init__
    return cls


@_refusals_name_their_setting
@dataclass(config=ConfigDict(extra="forbid"))
class SamplingParams:
    """Per-request generation settings, named as in vLLM.

    ``temperature == 0`` means greedy. ``top_k == 0`` (or -1, read as 0), ``top_p == 1`` and ``min_p == 0`` disable
    those filters. ``max_tokens=None`` means "until the model's length limit". ``min_tokens``: EOS,
    ``stop_token_ids`` and stop strings cannot end the request before this many tokens were generated (as in vLLM:
    those tokens are not sampled). ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, over the generated
    tokens), ``repetition_penalty`` (vLLM's, over prompt and generated tokens; 1 = off) and ``logit_bias`` (token id
    -> added to its logit) apply to greedy requests too (backend/engine/logits_processors.py).
    """

    max_tokens: Integer | None = _ranged("max_tokens", 16)
    min_tokens: Integer = _ranged("min_tokens", 0)
    temperature: Number = _ranged("temperature", 1.0)
    top_p: Number = _ranged("top_p", 1.0)
    top_k: Integer = _ranged("top_k", 0)
    seed: Integer | None = _ranged("seed", None)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[Integer] = Field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: Number = _ranged("presence_penalty", 0.0)
    frequency_penalty: Number = _ranged("frequency_penalty", 0.0)
    repetition_penalty: Number = _ranged("repetition_penalty", 1.0)
    min_p: Number = _ranged("min_p", 0.0)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    # The sampled token's log-probability and this many likeliest tokens' (None: none).
    logprobs: Integer | None = _ranged("logprobs", None)
    # Each prompt token's log-probability and this many likeliest tokens' at its position, the first token's None
    # (nothing precedes it); returned once, in the request's first output (None: not computed).
    prompt_logprobs: Integer | None = _ranged("prompt_logprobs", None)
    include_stop_str_in_output: bool = False  # a stop string that ends the text stays in it
    skip_special_tokens: bool = True  # special tokens (EOS, chat markers) are left out of the text
    structured_outputs: StructuredOutputs = None  # backend/engine/structured_output.py

    # Parallel sampling: n answers of one prompt, computed once (backend/engine/parallel_sampling.py). vLLM's
    # best_of (sample more, return the n likeliest) is not offered: it would need each sequence's log probability.
    n: Integer = _ranged("n", 1)

    @field_validator("top_k")
    @classmethod
    def _top_k_off_is_zero(cls, top_k: int) -> int:
        return 0 if top_k == -1 else top_k  # vLLM's other "off"

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, stop: Any) -> list[str]:
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed; got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest("stop", f"stop strings must be non-empty strings; got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest("stop",
                                     f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters; got {len(s)}")
        return stop

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _no_stop_token_ids(cls, token_ids: Any) -> Any:
        return [] if token_ids is None else token_ids

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_biases(cls, biases: Any) -> dict[int, float]:
        if biases is None:
            return {}
        if not isinstance(biases, dict):
            raise InvalidRequest("logit_bias", f"logit_bias must map token ids to biases; got {biases!r}")
        if len(biases) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequest("logit_bias", f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} tokens; "
                                               f"got {len(biases)}")
        allowed = SAMPLING_RANGES["logit_bias"]
        checked = {}
        for token, bias in biases.items():
            token_id = _token_id(token)  # JSON's keys are strings
            if token_id is None:
                raise InvalidRequest("logit_bias", f"logit_bias keys must be token ids (integers >= 0); got {token!r}")
            if bias not in allowed:
                raise InvalidRequest("logit_bias", f"logit_bias values must {allowed.requirement}; got {bias!r} "
                                                   f"for token {token_id}")
            checked[token_id] = float(bias)
        return checked

    @model_validator(mode="after")
    def _settings_agree(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens",
                                 f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:  # sequence i samples with seed + i
            raise InvalidRequest("seed", f"seed + n - 1 must fit in 64 bits (up to 2**64 - 1); got {self.seed}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuse token ids this model does not have (the sampler indexes its logits with them)."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            beyond = [t for t in ids if not 0 <= t < vocab_size]
            if beyond:
                raise InvalidRequest(name, f"{name} names token id {beyond[0]}; this model's token ids are "
                                           f"0 to {vocab_size - 1}")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler adjusts this request's logits before the draw (logits_processors.py)."""
        return self.has_penalties or bool(self.logit_bias) or (self.min_p > 0.0 and not self.greedy)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SamplingParams:
        """From what a request sent (Triton's ``sampling_parameters`` JSON and inputs): unknown keys refused."""
        if "best_of" in raw:
            raise InvalidRequest("best_of", "best_of is not supported: each of the n answers is returned; send n "
                                            "alone")
        refuse_unknown(raw, (f.name for f in fields(cls)), None, "unknown sampling parameter(s)")
        return cls(**raw)


def _token_id(token: Any) -> int | None:
    if isinstance(token, str) and token.strip().isascii() and token.strip().isdigit():
        return int(token)
    return token if isinstance(token, int) and not isinstance(token, bool) and token >= 0 else None


def _refusal(error: ErrorDetails) -> InvalidRequest:
    """pydantic's first error as the contract's refusal: a validator's own ``InvalidRequest`` as it is, a number out
    of its range (or no number) in the contract's words."""
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, InvalidRequest):
        return cause
    loc = error["loc"]
    name = str(loc[0]) if loc else None
    if error["type"] == "unexpected_keyword_argument" or error["type"] == "extra_forbidden":
        return InvalidRequest(None, f"unknown sampling parameter: {name}")
    if len(loc) == 1 and name in SAMPLING_RANGES:
        return InvalidRequest(name, f"{name} must {SAMPLING_RANGES[name].requirement}; got {error['input']!r}")
    where = "".join(f"[{part!r}]" for part in loc[1:])
    return InvalidRequest(name, f"{name}{where}: {error['msg']}; got {error['input']!r}")
