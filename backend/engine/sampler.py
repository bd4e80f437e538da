"""Batched next-token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

A seeded request draws its randomness from its own generator, one number per step, so its text does not depend on
which other requests share the batch; every per-row operation reads only that row, for the same reason. A row's
token is the inverse CDF of its number over the softmax weights, in vocabulary order, restricted to its top-k and
top-p prefix: one uniform number per row instead of noise over the whole vocabulary, and no sort of the vocabulary.

Before the draw, the rows that ask have their logits biased, penalised and ``min_p``-filtered
(backend/engine/logits_processors.py); a batch where no row asks skips that entirely.

``sample_rows`` is the torch reference; the C twin in ``backend.kernels.cpu_kernels`` (same inputs, same tokens up to
float rounding) runs wherever it builds, in one pass over each row.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from backend.engine.logits_processors import LogitsAdjustments
from backend.engine.sampling_params import SamplingParams
from backend.kernels import cpu_kernels


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and rank (1 = the likeliest), and the row's ``k`` likeliest tokens, in the
    distribution the token was drawn from: the logits after bias, penalties, banned tokens and min_p, at the row's
    temperature (1 for a greedy row), before top-k and top-p."""

    logprob: float
    rank: int
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # one per row; None where its request asked for none


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)  # for requests that did not ask for a seed
        self._seeded: dict[str, random.Random] = {}

    def forget(self, request_id: str) -> None:
        self._seeded.pop(request_id, None)

    def __call__(self, *args, **kwargs) -> list[int]:
        """:meth:`sample`'s token ids alone."""
        return self.sample(*args, **kwargs).token_ids

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        banned_token_ids: list[tuple[int, ...]] | None = None,
        token_ids: list[list[int]] | None = None,
        num_prompt_tokens: list[int] | None = None,
    ) -> SamplerOutput:
        """``logits`` ``[S, V]`` (any float dtype) → one token id per row; a row never picks its banned ids; the
        log-probabilities of the rows whose requests ask (``logprobs``).
        ``token_ids`` (each row's prompt and output so far, its first ``num_prompt_tokens`` the prompt) are read
        only by the rows with penalties."""
        logits = logits.cpu()
        for row, banned in enumerate(banned_token_ids or ()):
            if banned:  # min_tokens not reached yet: EOS and stop tokens are not candidates (vLLM's rule)
                logits[row, list(banned)] = float("-inf")
        # NOTE: after the bans, as vLLM orders them: min_p's threshold is the best token that can still be picked.
        adjustments = LogitsAdjustments.of(params, token_ids or [()] * len(params),
                                           num_prompt_tokens or [0] * len(params), logits.shape[-1])
        if adjustments is not None:
            logits = adjustments.apply(logits.float().contiguous())
        # NOTE: a greedy row draws nothing, so a request's draws never depend on its batch-mates' settings. One
        # tensor for all the settings: each tensor built is a few microseconds more (tens with the caches cold from
        # the forward), and the C sampler reads them from one array.
        settings = torch.tensor(
            [(p.temperature, p.top_k, p.top_p, 0.0 if p.greedy else self._rng_for(rid, p.seed).random())
             for rid, p in zip(request_ids, params)],
            dtype=torch.float64,
        ).reshape(-1, len(SETTINGS))
        if cpu_kernels.supports_sampling(logits):
            tokens = cpu_kernels.cpu_sample_rows(logits, settings)
        else:
            tokens = sample_rows(logits, settings)
        return SamplerOutput(tokens.tolist(), token_logprobs(logits, tokens, params))

    def _rng_for(self, request_id: str, seed: int | None) -> random.Random:
        if seed is None:
            return self._rng
        rng = self._seeded.get(request_id)
        if rng is None:
            rng = self._seeded[request_id] = random.Random(seed)
        return rng


# The columns of a settings tensor, [R, 4] float64 with one row per sampled row (float64 holds every top_k exactly;
# both twins round temperature and top_p to float32 before use).
SETTINGS = ("temperature", "top_k", "top_p", "uniform")


def sample_rows(
    logits: torch.Tensor,  # [R, V]
    settings: torch.Tensor,  # [R, 4] float64, columns SETTINGS: temperature (0 = greedy), top_k (0 = off), top_p
    # (1 = off), uniform (in [0, 1), each row's own random number)
) -> torch.Tensor:  # [R] int64
    """One token per row: argmax where the temperature is 0, else the first token whose cumulative weight (in
    vocabulary order, over the row's top-k and top-p prefix) exceeds ``uniform`` times the prefix's weight."""
    temperature, top_k, top_p = settings[:, 0].float(), settings[:, 1].long(), settings[:, 2].float()
    uniform = settings[:, 3]
    # NOTE: argmax on the model's dtype is exact (upcasting changes no order), and saves an [R, V] copy.
    tokens = logits.max(dim=-1).indices  # (R,) first index on ties, as argmax
    sampled = (temperature > 0).nonzero().flatten()
    if sampled.numel() == 0:
        return tokens
    x = logits[sampled].float() / temperature[sampled, None]  # (r, V)
    weights = (x - x.max(dim=-1, keepdim=True).values).exp()  # (r, V), the best token weighs 1; banned weigh 0
    vocab = weights.shape[-1]
    k, p = top_k[sampled], top_p[sampled]
    filtered = ((k > 0) & (k < vocab)) | (p < 1.0)
    if filtered.any():
        weights[filtered] = _keep_top_k_top_p(weights[filtered], k[filtered], p[filtered])
    cdf = weights.double().cumsum(dim=-1)  # (r, V)
    target = uniform[sampled] * cdf[:, -1]
    picked = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)
    tokens[sampled] = picked
    return tokens


def token_logprobs(
    logits: torch.Tensor,  # [S, V] as drawn from (adjusted, banned at -inf)
    tokens: torch.Tensor,  # [S] int64, the picks
    params: list[SamplingParams],
) -> list[TokenLogprobs | None]:
    """The picks' log-probabilities and each asking row's top ``logprobs`` tokens; nothing when no row asks. The C
    twin (one thread per row, no log-softmax written) wherever it builds, else :func:`logprob_rows`."""
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not asking:
        return [None] * len(params)
    rows = torch.tensor(asking)
    temperature = torch.tensor([1.0 if params[i].greedy else params[i].temperature for i in asking])
    k = max(params[i].logprobs for i in asking)
    if cpu_kernels.supports_sampling(logits):
        picked, ranks, top_ids, top_values = cpu_kernels.cpu_token_logprobs(logits, rows, temperature, tokens[rows], k)
    else:
        picked, ranks, top_ids, top_values = logprob_rows(logits, rows, temperature, tokens[rows], k)
    found: list[TokenLogprobs | None] = [None] * len(params)
    for i, logprob, rank, ids, values in zip(asking, picked.tolist(), ranks.tolist(), top_ids.tolist(),
                                             top_values.tolist()):
        n = params[i].logprobs
        found[i] = TokenLogprobs(logprob, rank, tuple(ids[:n]), tuple(values[:n]))
    return found


# Prompt rows are taken through the float32 log-softmax this many at a time: a long prompt's [P, V] in float32 would
# be gigabytes.
PROMPT_LOGPROB_ROWS = 256


@torch.inference_mode()
def prompt_token_logprobs(
    logits: torch.Tensor,  # [P, V] in the model's dtype, a prompt's rows (position p: the distribution of token p + 1)
    next_token_ids: list[int],  # [P], the prompt token each row predicts
    k: int,
) -> list[TokenLogprobs]:
    """vLLM's ``prompt_logprobs`` of these positions: each next prompt token's log-probability and rank, and the k
    likeliest tokens, under the log-softmax of the model's own logits in float32 (no temperature, bias or penalty:
    the prompt was not sampled)."""
    found = []
    for begin in range(0, len(next_token_ids), PROMPT_LOGPROB_ROWS):
        rows = logits[begin : begin + PROMPT_LOGPROB_ROWS]  # (r, V)
        logprobs = rows.float().log_softmax(dim=-1)  # (r, V)
        tokens = torch.tensor(next_token_ids[begin : begin + PROMPT_LOGPROB_ROWS], device=rows.device)  # (r,)
        picked = logprobs.gather(1, tokens[:, None])  # (r, 1)
        ranks = (logprobs > picked).sum(dim=-1) + 1  # (r,)
        top_values, top_ids = logprobs.topk(k, dim=-1)  # (r, k) each
        for logprob, rank, ids, values in zip(picked[:, 0].tolist(), ranks.tolist(), top_ids.tolist(),
                                              top_values.tolist()):
            found.append(TokenLogprobs(logprob, rank, tuple(ids), tuple(values)))
    return found


def logprob_rows(
    logits: torch.Tensor,  # [S, V]
    rows: torch.Tensor,  # [R] int64, which rows
    temperature: torch.Tensor,  # [R], each row's (1 for a greedy row)
    tokens: torch.Tensor,  # [R] int64, each row's pick
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference of ``cpu_token_logprobs``: the picks' log-probabilities [R] and ranks [R], and the top k
    ids and log-probabilities [R, k], under softmax(logits / temperature)."""
    x = logits.index_select(0, rows).float() / temperature.float()[:, None]  # (R, V)
    log_total = torch.logsumexp(x, dim=-1, keepdim=True)  # (R, 1): log-probability = x - log_total
    picked = x.gather(1, tokens[:, None])  # (R, 1)
    ranks = (x > picked).sum(dim=-1) + 1  # (R,)
    top_values, top_ids = x.topk(k, dim=-1) if k else (torch.empty(len(rows), 0), torch.empty(len(rows), 0))
    return (picked - log_total)[:, 0], ranks, top_ids, top_values - log_total


def _keep_top_k_top_p(weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every weight outside its row's top-k, then outside the top-p nucleus of what is left (ties in index
    order, as a stable sort puts them)."""
    sorted_w, order = weights.sort(dim=-1, descending=True, stable=True)  # (R, V)
    vocab = weights.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    keep = torch.arange(vocab)[None, :] < k  # (R, V)
    in_top_k = (sorted_w * keep).double()
    # NOTE: keep a token while the mass *before* it is below top_p of the top-k's mass, so the most likely token
    # always survives. Rows without a top-p filter are exempt: their cumulative sum may round up before the tail.
    before = in_top_k.cumsum(dim=-1) - in_top_k
    keep &= (before < top_p.double()[:, None] * in_top_k.sum(dim=-1, keepdim=True)) | (top_p >= 1.0)[:, None]
    return torch.zeros_like(weights).scatter_(1, order, sorted_w * keep)
