"""What each sampling setting may be: the one table of bounds that the engine's ``SamplingParams`` validates with
(backend/engine/sampling_params.py) and the OpenAI frontend's request models state (frontend/openai/protocol.py).

The meanings are vLLM's: ``temperature`` 0 is greedy, ``top_k`` 0 or -1 is off, ``top_p`` 1 and ``min_p`` 0 are off,
``repetition_penalty`` 1 is off. A bound is plain data; :attr:`Range.bounds` gives it as pydantic's ``Field``
keywords (``ge``, ``gt``, ``le``, ``lt``: annotated_types' names), which both readers pass on as they are, and
:attr:`Range.requirement` says it to a person, as every refusal does.

NOTE: standard library only, nothing else of the project imported (the package's rule, ``__init__.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

# Limits that protect the server from a single request (docs/server.md, "What a request may ask for").
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit, and vLLM's default max_logprobs
MAX_N = 16  # answers of one prompt (parallel sampling), each one sequence of the batch
# A seed is 64 bits: a signed one (torch's) or an unsigned one (the models' UINT64 input); sequence i of n samples
# with seed + i, so the engine also checks that seed + n - 1 fits.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class Range:
    """The values a setting may take: from ``lo`` to ``hi`` (None: unbounded on that side), each end included unless
    it is ``*_open``; whole numbers only when ``integer``."""

    lo: int | float | None = None
    hi: int | float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    note: str = ""  # what special values mean ("0 = greedy"), said after the range
    text: str = ""  # the requirement in words, where the bounds' own numbers would not read well

    @property
    def bounds(self) -> dict[str, int | float]:
        """As pydantic's ``Field`` keywords: ``{"gt": 0, "le": 1}`` for (0, 1]."""
        found: dict[str, int | float] = {}
        if self.lo is not None:
            found["gt" if self.lo_open else "ge"] = self.lo
        if self.hi is not None:
            found["lt" if self.hi_open else "le"] = self.hi
        return found

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):  # NaN and infinities are in no range
            return False
        if self.integer and not isinstance(value, int):
            return False
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below

    @property
    def requirement(self) -> str:
        """What a value must do, for a person: "be in (0, 1]", "be an integer from 1 to 16"."""
        if self.text:
            return self.text
        unbounded = self.lo is None or self.hi is None
        kind = "an integer" if self.integer else "a finite number" if unbounded else "a number"
        if self.lo is not None and self.hi is not None:
            if self.integer and not (self.lo_open or self.hi_open):
                what = f"{kind} from {self.lo} to {self.hi}"
            else:
                what = f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            positive = self.integer and ((self.lo == 1 and not self.lo_open) or (self.lo == 0 and self.lo_open))
            what = "a positive integer" if positive else f"{kind} {'>' if self.lo_open else '>='} {self.lo}"
        elif self.hi is not None:
            what = f"{kind} {'<' if self.hi_open else '<='} {self.hi}"
        else:
            what = kind
        return f"be {what}" + (f" ({self.note})" if self.note else "")


# Setting (vLLM's SamplingParams' name) -> its range. ``logit_bias``: the range of each token's bias.
SAMPLING_RANGES: MappingProxyType[str, Range] = MappingProxyType({
    "max_tokens": Range(lo=1, integer=True),
    "min_tokens": Range(lo=0, integer=True),
    "temperature": Range(lo=0, note="0 = greedy"),
    "top_p": Range(lo=0, hi=1, lo_open=True),
    "top_k": Range(lo=-1, integer=True, note="0 or -1 = off"),
    "min_p": Range(lo=0, hi=1, note="0 = off"),
    "presence_penalty": Range(lo=-2, hi=2),
    "frequency_penalty": Range(lo=-2, hi=2),
    "repetition_penalty": Range(lo=0, lo_open=True, note="1 = off"),
    "logit_bias": Range(lo=-100, hi=100),
    "seed": Range(lo=MIN_SEED, hi=MAX_SEED, integer=True,
                  text="fit in 64 bits (be an integer from -2**63 to 2**64 - 1)"),
    "n": Range(lo=1, hi=MAX_N, integer=True),
    "logprobs": Range(lo=0, hi=MAX_LOGPROBS, integer=True,
                      note="the likeliest tokens to return beside the sampled one"),
    "prompt_logprobs": Range(lo=0, hi=MAX_LOGPROBS, integer=True,
                             note="the likeliest tokens to return beside each prompt token"),
})
