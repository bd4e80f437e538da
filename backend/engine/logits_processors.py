"""What a request's settings do to its logits before the draw, in vLLM's order: ``logit_bias``, then the penalties
(``repetition_penalty`` over prompt and output, ``frequency_penalty`` and ``presence_penalty`` over the output, as
OpenAI defines them), then ``min_p`` on the temperature-scaled distribution.

Each is one tensor operation over every row that uses it; :class:`LogitsAdjustments` gathers the rows' settings into
per-row tensors once per step (a Python pass over the rows' settings and token ids, none over the vocabulary). The
sampler builds it only when some row of the batch asks, so the default path costs one check per row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backend.engine.config import SamplingParams


@dataclass(frozen=True)
class LogitsAdjustments:
    """The adjusted rows' settings as tensors; ``rows`` indexes the step's logits."""

    rows: torch.Tensor  # (R,) int64
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row in R, token, bias), each (n,)
    prompt_ids: tuple[torch.Tensor, torch.Tensor] | None  # (row in R, token), each (p,): the prompts' tokens
    output_ids: tuple[torch.Tensor, torch.Tensor] | None  # (row in R, token), each (o,): the generated tokens
    presence: torch.Tensor  # (R,) float32
    frequency: torch.Tensor  # (R,) float32
    repetition: torch.Tensor  # (R,) float32
    temperature: torch.Tensor  # (R,) float32, 0 = greedy
    min_p: torch.Tensor  # (R,) float32

    @classmethod
    def of(cls, params: Sequence[SamplingParams], token_ids: Sequence[Sequence[int]],
           num_prompt_tokens: Sequence[int]) -> LogitsAdjustments | None:
        """The settings of the rows that adjust their logits; None when no row does."""
        rows = [i for i, p in enumerate(params) if p.adjusts_logits]
        if not rows:
            return None
        chosen = [params[i] for i in rows]
        biased = [(r, int(t), b) for r, p in enumerate(chosen) for t, b in p.logit_bias.items()]
        penalized = [r for r, p in enumerate(chosen) if p.has_penalties]
        return cls(
            rows=torch.tensor(rows),
            bias=tuple(torch.tensor(c) for c in zip(*biased)) if biased else None,
            prompt_ids=_flat_ids([(r, token_ids[rows[r]][:num_prompt_tokens[rows[r]]]) for r in penalized]),
            output_ids=_flat_ids([(r, token_ids[rows[r]][num_prompt_tokens[rows[r]]:]) for r in penalized]),
            presence=torch.tensor([p.presence_penalty for p in chosen], dtype=torch.float32),
            frequency=torch.tensor([p.frequency_penalty for p in chosen], dtype=torch.float32),
            repetition=torch.tensor([p.repetition_penalty for p in chosen], dtype=torch.float32),
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in chosen], dtype=torch.float32),
            min_p=torch.tensor([p.min_p for p in chosen], dtype=torch.float32),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (S, V) float32 with the chosen rows adjusted (in place)."""
        x = logits[self.rows]  # (R, V)
        if self.bias is not None:
            x.index_put_((self.bias[0], self.bias[1]), self.bias[2].float(), accumulate=True)
        if self.output_ids is not None or self.prompt_ids is not None:
            x = apply_penalties(x, self.prompt_mask(x.shape), self.output_counts(x.shape),
                                self.presence, self.frequency, self.repetition)
        if bool((self.min_p > 0).any()):
            x = apply_min_p(x, self.temperature, self.min_p)
        logits[self.rows] = x
        return logits

    def prompt_mask(self, shape: torch.Size) -> torch.Tensor:  # (R, V) bool
        mask = torch.zeros(shape, dtype=torch.bool)
        if self.prompt_ids is not None:
            mask[self.prompt_ids] = True
        return mask

    def output_counts(self, shape: torch.Size) -> torch.Tensor:  # (R, V) float32
        counts = torch.zeros(shape, dtype=torch.float32)
        if self.output_ids is not None:
            counts.index_put_(self.output_ids, torch.ones(self.output_ids[0].numel()), accumulate=True)
        return counts


def apply_penalties(
    logits: torch.Tensor,  # (R, V) float32
    prompt_mask: torch.Tensor,  # (R, V) bool: the token is in the row's prompt
    output_counts: torch.Tensor,  # (R, V) float32: how often the row generated the token
    presence: torch.Tensor,  # (R,)
    frequency: torch.Tensor,  # (R,)
    repetition: torch.Tensor,  # (R,) 1 = off
) -> torch.Tensor:  # (R, V)
    """vLLM's penalties: a token seen in the prompt or output has a positive logit divided by, a negative one
    multiplied by, ``repetition``; then OpenAI's ``frequency * count + presence * (count > 0)`` is subtracted."""
    output_mask = output_counts > 0
    seen = prompt_mask | output_mask
    scale = torch.where(seen, repetition[:, None], torch.ones_like(logits))  # (R, V)
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    return logits - frequency[:, None] * output_counts - presence[:, None] * output_mask


def apply_min_p(
    logits: torch.Tensor,  # (R, V) float32
    temperature: torch.Tensor,  # (R,) 0 = greedy: left alone (min_p never drops the best token)
    min_p: torch.Tensor,  # (R,) 0 = off
) -> torch.Tensor:  # (R, V)
    """Drop (-inf) the tokens whose probability at the row's temperature is below ``min_p`` times the best one's:
    ``logit / T < max / T + log(min_p)``, the same test as vLLM's on the probabilities."""
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]  # -inf where min_p is 0
    drop = (scaled < floor) & (temperature > 0)[:, None]
    return logits.masked_fill(drop, -math.inf)


def _flat_ids(rows: list[tuple[int, Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) index tensors of every token of every row; None when there are none."""
    counts = [len(ids) for _, ids in rows]
    if not sum(counts):
        return None
    row_index = torch.repeat_interleave(torch.tensor([r for r, _ in rows]), torch.tensor(counts))
    return row_index, torch.tensor(list(itertools.chain.from_iterable(ids for _, ids in rows)))
