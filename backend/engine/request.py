"""A request as the engine sees it: a sequence of token ids, how many of them are in the KV cache, and its blocks.

Pure Python (no torch): the scheduler and block manager work on these objects only.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from backend.contract.errors import InvalidRequest
from backend.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # the engine failed while running this request
    REFUSED = "refused"  # the engine would not take it (a prompt too long, a request that can never fit)


@dataclass
class RequestTimings:
    """Wall-clock instants (``time.perf_counter``) in a request's life; ``None`` until reached."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Request:
    """One sequence: prompt + generated tokens.

    NOTE: there is no separate "prefill" or "decode" state. ``num_computed_tokens`` counts tokens whose K/V are in
    the cache; the scheduler's only rule is to bring it up to ``num_tokens``. A prefill, a prefill chunk, a decode
    and a resume after preemption are all that rule.

    ``priority`` is vLLM's: a lower value is served earlier (0 by default); only the scheduler's ``priority``
    policy reads it. It sits beside the sampling settings, not among them: it says when, not what, to generate.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequest("priority", f"priority must be an integer (lower is served earlier); got {priority!r}")
        self.priority = priority
        self.request_id = request_id
        self.sampling_params = sampling_params or SamplingParams()
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []  # the block table: logical block i lives in physical block block_ids[i]
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids (prefix caching)
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at the last admission
        self.eos_token_ids = eos_token_ids
        self.timings = RequestTimings() if arrival_time is None else RequestTimings(arrival=arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the steps that compute this prompt must keep its logits (``prompt_logprobs``): until its first
        token is sampled, after which they have been returned (a prompt recomputed after preemption needs none)."""
        return self.sampling_params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Tokens the sampler must not pick now: EOS and stop tokens until ``min_tokens`` are generated."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            return ()
        return (*(() if params.ignore_eos else self.eos_token_ids), *params.stop_token_ids)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """Token-level stop conditions after a token was appended (stop strings are the detokenizer's job)."""
        last = self.token_ids[-1]
        params = self.sampling_params
        if not params.ignore_eos and last in self.eos_token_ids:
            return FinishReason.STOP
        if last in params.stop_token_ids:
            return FinishReason.STOP
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_ids)}, {self.status.value})"
        )
