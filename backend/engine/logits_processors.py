"""What a request's settings do to its logits before the draw, in vLLM's order: ``logit_bias``, then the penalties
(``repetition_penalty`` over prompt and output, ``frequency_penalty`` and ``presence_penalty`` over the output, as
OpenAI defines them), then ``min_p`` on the temperature-scaled distribution.

Each is one tensor operation over the whole batch; :class:`LogitsAdjustments` gathers the rows' settings into
per-row tensors once per step (a Python pass over the rows' settings and token ids, none over the vocabulary), and
the penalties touch only the tokens a row has seen. The sampler builds it only when some row of the batch asks, so
the default path costs one check per row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backend.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitsAdjustments:
    """The step's settings as tensors, one entry per row of the logits (neutral where a row does not ask); the
    tokens to bias or penalise as flat indices into the logits, ``row * V + token``, so a penalty costs what the
    row's tokens number, not what the vocabulary does."""

    bias: tuple[torch.Tensor, torch.Tensor] | None  # flat indices (b,) int64, biases (b,) float32
    prompt_ids: torch.Tensor | None  # (p,) int64 flat indices of the penalised rows' prompt tokens (repeats allowed)
    output_ids: torch.Tensor | None  # (o,) int64 flat indices of their generated tokens (repeats allowed)
    presence: torch.Tensor  # (S,) float32
    frequency: torch.Tensor  # (S,) float32
    repetition: torch.Tensor  # (S,) float32, 1 = off
    temperature: torch.Tensor  # (S,) float32, 0 = greedy
    min_p: torch.Tensor  # (S,) float32, 0 = off

    @classmethod
    def of(cls, params: Sequence[SamplingParams], token_ids: Sequence[Sequence[int]],
           num_prompt_tokens: Sequence[int], vocab_size: int) -> LogitsAdjustments | None:
        """The step's settings; None when no row adjusts its logits."""
        if not any(p.adjusts_logits for p in params):
            return None
        biased = [(row * vocab_size + token, bias)
                  for row, p in enumerate(params) for token, bias in p.logit_bias.items()]
        penalized = [row for row, p in enumerate(params) if p.has_penalties]
        return cls(
            bias=(torch.tensor([i for i, _ in biased]), torch.tensor([b for _, b in biased])) if biased else None,
            prompt_ids=_flat_ids([(r, token_ids[r][:num_prompt_tokens[r]]) for r in penalized], vocab_size),
            output_ids=_flat_ids([(r, token_ids[r][num_prompt_tokens[r]:]) for r in penalized], vocab_size),
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (S, V) float32, contiguous, adjusted in place: bias, penalties, then min_p."""
        flat = logits.view(-1)  # (S * V,)
        if self.bias is not None:
            flat.index_add_(0, self.bias[0], self.bias[1])
        if self.prompt_ids is not None or self.output_ids is not None:
            apply_penalties(flat, logits.shape[1], self.prompt_ids, self.output_ids, self.presence, self.frequency,
                            self.repetition)
        rows = (self.min_p > 0).nonzero().flatten()
        if rows.numel():
            logits[rows] = apply_min_p(logits[rows], self.temperature[rows], self.min_p[rows])
        return logits


def apply_penalties(
    flat: torch.Tensor,  # (S * V,) float32: the logits, adjusted in place
    vocab_size: int,
    prompt_ids: torch.Tensor | None,  # (p,) flat indices of prompt tokens
    output_ids: torch.Tensor | None,  # (o,) flat indices of generated tokens, once per time generated
    presence: torch.Tensor,  # (S,)
    frequency: torch.Tensor,  # (S,)
    repetition: torch.Tensor,  # (S,)
) -> None:
    """vLLM's penalties: a token seen in the prompt or output has a positive logit divided by, a negative one
    multiplied by, its row's ``repetition``; then OpenAI's ``frequency * count + presence * (count > 0)`` is
    subtracted. Only the seen tokens are read and written."""
    seen = torch.cat([ids for ids in (prompt_ids, output_ids) if ids is not None]).unique()  # (n,)
    scale = repetition[seen // vocab_size]
    values = flat[seen]
    flat[seen] = torch.where(values > 0, values / scale, values * scale)
    if output_ids is not None:
        generated, counts = output_ids.unique(return_counts=True)  # (m,)
        rows = generated // vocab_size
        flat.index_add_(0, generated, -(frequency[rows] * counts + presence[rows]))


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


def _flat_ids(rows: list[tuple[int, Sequence[int]]], vocab_size: int) -> torch.Tensor | None:
    """``row * V + token`` of every token of every row; None when there are none."""
    counts = [len(ids) for _, ids in rows]
    if not sum(counts):
        return None
    starts = torch.repeat_interleave(torch.tensor([r * vocab_size for r, _ in rows]), torch.tensor(counts))
    return starts + torch.tensor(list(itertools.chain.from_iterable(ids for _, ids in rows)))
