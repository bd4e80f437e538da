"""Attention over the paged KV cache: the metadata one step needs, and the torch reference implementation.

The KV pool of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence's
token at position ``p`` lives in physical block ``block_table[p // block_size]``, offset ``p % block_size``; its
flat *slot* is ``block * block_size + offset``.

A step's tokens arrive flattened into one stream ``[T, ...]`` ordered as: decode tokens (one query per sequence)
first, then each prefill chunk. Decodes are attended in one batched call; prefill chunks one call each, against
their cached prefix plus the chunk itself with a causal mask.

The decode function here and the OpenAI Triton kernel in ``backend/kernels`` share one signature
(``paged_decode_attention``); tests compare them and the device decides which runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's chunk of ``num_query_tokens`` tokens in this step."""

    token_start: int  # index of the chunk's first token in the step's token stream
    num_query_tokens: int
    num_cached_tokens: int  # tokens of this sequence already in the cache before this step
    context_slots: torch.Tensor | None  # [num_cached + num_query] slots to gather, None when nothing is cached


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step; built once per step by the model runner, passed to every layer."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    num_decode_tokens: int  # the first num_decode_tokens of the stream are single-token decodes
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, padded with 0 (masked by context_lens)
    context_lens: torch.Tensor  # [num_decodes] int32: tokens each decode attends to (its own included)
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] int64 gather indices for the torch path
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] bool, True where attended
    prefills: tuple[PrefillChunk, ...]
    scale: float


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    """Store the step's new K/V in their slots (the torch twin of the reshape-and-cache kernel)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    slots: torch.Tensor | None = None,  # [B, max_context] precomputed gather indices (optional, saves work per layer)
    mask: torch.Tensor | None = None,  # [B, 1, 1, max_context] bool
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """Torch reference for decode: gather each sequence's K/V through its block table, attend with padding masked."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if slots is None or mask is None:
        slots, mask = decode_gather_indices(block_tables, context_lens, block_size)
    keys = k_cache.view(-1, num_kv_heads, head_dim)[slots]  # (B, ctx, kvh, hd)
    values = v_cache.view(-1, num_kv_heads, head_dim)[slots]
    group = num_heads // num_kv_heads
    # NOTE: with one query per sequence, the query heads sharing a KV head can stand in SDPA's "query length"
    # dimension, so grouped-query attention needs no copy of K/V per query head.
    q = query.view(batch, num_kv_heads, group, head_dim)  # (B, kvh, g, hd)
    out = F.scaled_dot_product_attention(
        q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
    )  # (B, kvh, g, hd)
    return out.reshape(batch, num_heads, head_dim)


def decode_gather_indices(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slot indices ``[B, max_context]`` and the padding mask ``[B, 1, 1, max_context]`` for the torch path."""
    max_context = int(context_lens.max())
    num_blocks = (max_context + block_size - 1) // block_size
    offsets = torch.arange(block_size, device=block_tables.device)
    slots = (block_tables[:, :num_blocks, None].long() * block_size + offsets).flatten(1)[:, :max_context]
    positions = torch.arange(max_context, device=block_tables.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]
    return slots, mask


def prefill_attention(
    query: torch.Tensor,  # [n, num_heads, head_dim] the chunk's queries
    key: torch.Tensor,  # [n, num_kv_heads, head_dim] the chunk's own keys (already written to the cache)
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:  # [n, num_heads, head_dim]
    """A chunk attends to its cached prefix plus itself, causally. Query i sits at position num_cached + i."""
    n, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if chunk.context_slots is not None:
        key = k_cache.view(-1, num_kv_heads, head_dim)[chunk.context_slots]  # (ctx, kvh, hd)
        value = v_cache.view(-1, num_kv_heads, head_dim)[chunk.context_slots]
    context = key.shape[0]
    q = query.transpose(0, 1)  # (H, n, hd)
    k = key.transpose(0, 1)  # (kvh, ctx, hd)
    v = value.transpose(0, 1)
    if context == n:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # NOTE: SDPA's is_causal aligns the mask top-left; with a cached prefix the diagonal is offset.
        rows = torch.arange(n, device=query.device)[:, None] + (context - n)
        mask = torch.arange(context, device=query.device)[None, :] <= rows  # (n, ctx)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # (n, H, hd)


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    decode_fn=paged_decode_attention,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """One layer's attention for a whole step: write the new K/V, then decodes in one call, prefill chunks each."""
    write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
    nd = meta.num_decode_tokens
    if not meta.prefills:
        return decode_fn(
            query, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.scale, meta.decode_slots, meta.decode_mask
        )
    out = torch.empty_like(query)
    if nd:
        out[:nd] = decode_fn(
            query[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, meta.scale,
            meta.decode_slots, meta.decode_mask,
        )
    for chunk in meta.prefills:
        span = slice(chunk.token_start, chunk.token_start + chunk.num_query_tokens)
        out[span] = prefill_attention(query[span], key[span], value[span], k_cache, v_cache, chunk, meta.scale)
    return out
