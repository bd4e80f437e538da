"""The torch reference of attention over the paged KV cache: the plain path every other backend is compared with.

Each function has a kernel twin with the same signature (``backend/kernels``: the OpenAI Triton kernels, the C
kernels in ``cpu_kernels``); tests compare them. Decodes are attended in one batched call; prefill chunks against
their cached prefix plus the chunk itself with a causal mask (fresh chunks of equal length in one batched call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.engine.attention.base import AttentionBackend, AttentionMetadata, PrefillChunk


@dataclass(frozen=True)
class TorchAttentionMetadata(AttentionMetadata):
    """The common metadata plus the decode gather's indices, built once per step instead of once per layer."""

    decode_block_ids: torch.Tensor | None  # [num_decodes * max_blocks] int64 blocks to gather, None without decodes
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] float32 additive mask (0 / -inf)


class TorchAttention(AttentionBackend):
    """Rotary embedding, K/V write and attention as torch ops."""

    name = "torch"

    def build_metadata(self, common: AttentionMetadata) -> TorchAttentionMetadata:
        block_ids = mask = None
        if common.num_decode_tokens:
            block_ids, mask = decode_gather_indices(common.block_tables, common.context_lens, common.block_size)
        return common.extend(TorchAttentionMetadata, decode_block_ids=block_ids, decode_mask=mask)

    def forward(self, qkv, positions, cos, sin_signed, k_cache, v_cache, meta, num_heads):
        query, key, value = rope_qkv(qkv, positions, cos, sin_signed, num_heads, k_cache.shape[2])
        return paged_attention(query, key, value, k_cache, v_cache, meta)


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


def decode_gather_indices(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's per-step decode metadata, shared by every layer.

    Returns the flat block ids to gather ``[B * max_blocks]`` (whole blocks: one contiguous row each, far cheaper to
    copy than token slots) and the additive padding mask ``[B, 1, 1, max_blocks * block_size]`` in ``dtype``.
    """
    batch, max_blocks = block_tables.shape
    block_ids = block_tables.reshape(-1).long()
    positions = torch.arange(max_blocks * block_size, device=block_tables.device)
    padding = positions[None, :] >= context_lens[:, None]  # (B, ctx)
    mask = torch.zeros(padding.shape, dtype=dtype, device=block_tables.device).masked_fill_(padding, float("-inf"))
    return block_ids, mask.view(batch, 1, 1, -1)


def paged_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    scale: float,
    slots: torch.Tensor | None = None,  # [B * max_blocks] from decode_gather_indices (optional, saves work per layer)
    mask: torch.Tensor | None = None,  # [B, 1, 1, max_blocks * block_size] from decode_gather_indices
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """Torch reference for decode: gather each sequence's K/V blocks through its block table, attend with padding
    masked."""
    batch, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    if slots is None or mask is None:
        slots, mask = decode_gather_indices(block_tables, context_lens, block_size, query.dtype)
    context = mask.shape[-1]
    # NOTE: index_select over whole blocks (rows of block_size * kvh * hd) copies at memory speed; indexing by
    # token slot is several times slower on CPU.
    keys = k_cache.view(num_blocks, -1).index_select(0, slots).view(batch, context, num_kv_heads, head_dim)
    values = v_cache.view(num_blocks, -1).index_select(0, slots).view(batch, context, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    # NOTE: with one query per sequence, the query heads sharing a KV head can stand in SDPA's "query length"
    # dimension, so grouped-query attention needs no copy of K/V per query head.
    q = query.view(batch, num_kv_heads, group, head_dim)  # (B, kvh, g, hd)
    out = F.scaled_dot_product_attention(
        q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask.to(query.dtype), scale=scale
    )  # (B, kvh, g, hd)
    return out.reshape(batch, num_heads, head_dim)


def prefill_attention(
    query: torch.Tensor,  # [n, num_heads, head_dim] the chunk's queries
    key: torch.Tensor,  # [n, num_kv_heads, head_dim] the chunk's own keys (already written to the cache)
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_slots: torch.Tensor | None,  # [num_cached + n] the slots of the chunk's whole context; None: nothing cached
    scale: float,
) -> torch.Tensor:  # [n, num_heads, head_dim]
    """A chunk attends to its cached prefix plus itself, causally. Query i sits at position num_cached + i."""
    n, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if context_slots is not None:
        key = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, context_slots)  # (ctx, kvh, hd)
        value = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, context_slots)
    context = key.shape[0]
    # NOTE: 4-D inputs: on CPU, 3-D ones miss SDPA's flash kernel and take the math path (3x slower at 512 tokens).
    q = query.transpose(0, 1)[None]  # (1, H, n, hd)
    k = key.transpose(0, 1)[None]  # (1, kvh, ctx, hd)
    v = value.transpose(0, 1)[None]
    if context == n:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # NOTE: SDPA's is_causal aligns the mask top-left; with a cached prefix the diagonal is offset.
        rows = torch.arange(n, device=query.device)[:, None] + (context - n)
        mask = torch.arange(context, device=query.device)[None, :] <= rows  # (n, ctx)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)  # (n, H, hd)


def fresh_prefill_attention(
    query: torch.Tensor,  # [c * n, num_heads, head_dim]: c chunks of n tokens each, nothing cached
    key: torch.Tensor,  # [c * n, num_kv_heads, head_dim]
    value: torch.Tensor,
    num_chunks: int,
    scale: float,
) -> torch.Tensor:  # [c * n, num_heads, head_dim]
    """Equal-length chunks with no cached prefix (e.g. a batch of prompts) in one causal SDPA call."""
    total, num_heads, head_dim = query.shape
    n = total // num_chunks
    q = query.view(num_chunks, n, num_heads, head_dim).transpose(1, 2)  # (c, H, n, hd)
    k = key.reshape(num_chunks, n, -1, head_dim).transpose(1, 2)  # (c, kvh, n, hd)
    v = value.reshape(num_chunks, n, -1, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(total, num_heads, head_dim)


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,  # TorchAttentionMetadata saves each layer the decode gather's indices
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """One layer's attention for a whole step: write the new K/V, then decodes in one call, prefill chunks after."""
    write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
    num_decodes = meta.num_decode_tokens
    gather = (meta.decode_block_ids, meta.decode_mask) if isinstance(meta, TorchAttentionMetadata) else (None, None)
    decode = (query[:num_decodes], k_cache, v_cache, meta.block_tables, meta.context_lens, meta.scale, *gather)
    if not meta.prefills:
        return paged_decode_attention(*decode)
    out = torch.empty_like(query)
    if num_decodes:
        out[:num_decodes] = paged_decode_attention(*decode)
    attend_prefills(out, query, key, value, k_cache, v_cache, meta.prefills, meta.scale)
    return out


def attend_prefills(
    out: torch.Tensor,  # [T, num_heads, head_dim], written at the prefill chunks' rows
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim], already written to the cache
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefills: tuple[PrefillChunk, ...],
    scale: float,
) -> None:
    """The step's prefill chunks: runs of fresh equal-length chunks in one call, any other chunk alone."""
    for group in _prefill_groups(prefills):
        first = group[0]
        span = slice(first.token_start, first.token_start + first.num_query_tokens * len(group))
        if len(group) > 1:
            out[span] = fresh_prefill_attention(query[span], key[span], value[span], len(group), scale)
        else:
            out[span] = prefill_attention(query[span], key[span], value[span], k_cache, v_cache, first.context_slots,
                                          scale)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in HF's non-interleaved layout: x * cos + rotate_half(x) * sin.  x: (T, heads, hd).

    ``sin_signed`` is ``[-sin_lo, sin_hi]``: rotate_half(x) * sin == swap_halves(x) * sin_signed, so the rotation is
    three ops; ``cos`` and ``sin_signed`` are (T, 1, hd), each token's rows of the tables.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # (T, heads, hd)
    return torch.addcmul(x * cos, swapped, sin_signed)


def rope_qkv(
    qkv: torch.Tensor,  # [T, (num_heads + 2 num_kv_heads) head_dim], the QKV projection's output
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_len, head_dim] the whole table
    sin_signed: torch.Tensor,  # [max_len, head_dim]
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q (T, H, hd), k (T, kvh, hd), v (T, kvh, hd)
    """The QKV projection's output as rotated queries and keys, and values (a view)."""
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    qk_size = (num_heads + num_kv_heads) * head_dim
    rows = lambda table: table.index_select(0, positions)[:, None, :]  # noqa: E731  (T, 1, hd)
    qk = rotate(qkv[:, :qk_size].view(num_tokens, num_heads + num_kv_heads, head_dim), rows(cos), rows(sin_signed))
    value = qkv[:, qk_size:].view(num_tokens, num_kv_heads, head_dim)  # (T, kvh, hd)
    return qk[:, :num_heads], qk[:, num_heads:], value


def _prefill_groups(prefills: tuple[PrefillChunk, ...]) -> list[list[PrefillChunk]]:
    """Runs of adjacent fresh chunks of equal length (batched together); any other chunk alone."""
    groups: list[list[PrefillChunk]] = []
    for chunk in prefills:
        last = groups[-1][-1] if groups else None
        if (
            last is not None
            and chunk.context_slots is None
            and last.context_slots is None
            and chunk.num_query_tokens == last.num_query_tokens
        ):
            groups[-1].append(chunk)
        else:
            groups.append([chunk])
    return groups
