"""Batched next-token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

A seeded request draws its randomness from its own generator, one draw per step, so its text does not depend on
which other requests share the batch. Every per-row operation here (scaling, filtering, softmax, noise) reads only
that row, for the same reason.
"""

from __future__ import annotations

import torch

from backend.config import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)  # for requests that did not ask for a seed
        self._seeded: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._seeded.pop(request_id, None)

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        banned_token_ids: list[tuple[int, ...]] | None = None,
    ) -> list[int]:
        """``logits`` ``[S, V]`` (any float dtype) → one token id per row; a row never picks its banned ids."""
        logits = logits.cpu()
        for row, banned in enumerate(banned_token_ids or ()):
            if banned:  # min_tokens not reached yet: EOS and stop tokens are not candidates (vLLM's rule)
                logits[row, list(banned)] = float("-inf")
        # NOTE: argmax on the model's dtype is exact (upcasting changes no order), and saves an [S, V] copy.
        tokens = logits.max(dim=-1).indices  # (S,) greedy for every row (first index on ties, as argmax); random rows are overwritten below
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            picked = self._sample_rows(
                logits[rows].float(), [request_ids[i] for i in rows], [params[i] for i in rows]
            )
            tokens[rows] = picked
        return tokens.tolist()

    def _sample_rows(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> torch.Tensor:
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
        logits = logits / temperature  # (R, V)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = _apply_top_k_top_p(logits, params)
        probs = logits.softmax(dim=-1)  # (R, V)
        # Gumbel-max in its exponential form: argmax(p / E) with E ~ Exp(1) samples from p.
        noise = torch.empty_like(probs)
        for row, (request_id, p) in enumerate(zip(request_ids, params)):
            noise[row].exponential_(generator=self._generator_for(request_id, p.seed))
        return (probs / noise).argmax(dim=-1)

    def _generator_for(self, request_id: str, seed: int | None) -> torch.Generator:
        if seed is None:
            return self._generator
        gen = self._seeded.get(request_id)
        if gen is None:
            gen = self._seeded[request_id] = torch.Generator().manual_seed(seed)
        return gen


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (R, V)
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])[:, None]
    ranks = torch.arange(vocab)[None, :]
    remove = ranks >= top_k  # (R, V)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # NOTE: keep a token while the mass *before* it is below top_p, so the most likely token always survives.
    # Rows without a top-p filter are exempt: their cumulative sum may round up to 1.0 before the tail.
    remove |= ((probs.cumsum(dim=-1) - probs) >= top_p) & (top_p < 1.0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
