"""Attention over the paged KV cache: the metadata one step needs, and the torch reference implementation.

The KV pool of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence's
token at position ``p`` lives in physical block ``block_table[p // block_size]``, offset ``p % block_size``; its
flat *slot* is ``block * block_size + offset``.

A step's tokens arrive flattened into one stream ``[T, ...]`` ordered as: decode tokens (one query per sequence)
first, then each prefill chunk. Decodes are attended in one batched call; prefill chunks against their cached prefix
plus the chunk itself with a causal mask (fresh chunks of equal length in one batched call).

The functions here and their twins (the OpenAI Triton kernels in ``backend/kernels``, the C decode kernel in
``backend/cpu_kernels``) share one signature each; tests compare them. The device decides which runs, once: the model
runner picks an :class:`AttentionBackend` (one layer's attention for a whole step, ``paged_attention``'s signature)
and the model calls it in every layer.
"""

from __future__ import annotations

from collections.abc import Callable
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
class PrefillTables:
    """The step's prefill chunks as the kernels read them (on the device), built once per step for every layer."""

    block_tables: torch.Tensor  # [C, max_blocks] int32, padded with 0 (never read past a chunk's context)
    query_starts: torch.Tensor  # [C] int32: each chunk's first token in the step's stream
    query_lens: torch.Tensor  # [C] int32
    num_cached: torch.Tensor  # [C] int32
    max_query_len: int  # host-side bound on query_lens: sizes the kernel's grid without a device sync

    @classmethod
    def build(cls, prefills: tuple[PrefillChunk, ...], block_tables: torch.Tensor) -> "PrefillTables":
        """The chunks' starts, lengths and cached counts beside their block tables, on the tables' device."""
        starts, lens, cached = torch.tensor(
            [[c.token_start for c in prefills], [c.num_query_tokens for c in prefills],
             [c.num_cached_tokens for c in prefills]], dtype=torch.int32,
        ).to(block_tables.device)  # (3, C): one copy to the device
        return cls(block_tables, starts, lens, cached, max(c.num_query_tokens for c in prefills))


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step; built once per step by the model runner, passed to every layer."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    num_decode_tokens: int  # the first num_decode_tokens of the stream are single-token decodes
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, padded with 0 (masked by context_lens)
    context_lens: torch.Tensor  # [num_decodes] int32: tokens each decode attends to (its own included)
    decode_block_ids: torch.Tensor | None  # [num_decodes * max_blocks] int64 blocks to gather (torch path), or None
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] additive mask (0 / -inf)
    prefills: tuple[PrefillChunk, ...]
    scale: float
    prefill_tables: PrefillTables | None = None  # the kernels' view of ``prefills``, when the backend reads it


AttentionFn = Callable[..., torch.Tensor]  # (query, key, value, k_cache, v_cache, meta) -> [T, num_heads, head_dim]
# (qkv, positions, cos, sin_signed, k_cache, v_cache, meta, num_heads) -> [T, num_heads, head_dim]
RopeAttentionFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class AttentionBackend:
    """One layer's attention for a whole step, chosen once by device, and the optional metadata it reads.

    ``forward`` has ``paged_attention``'s signature. ``rope_forward``, where a backend has one, takes the layer from
    its QKV projection instead (``rope_paged_attention``'s signature: rotary embedding, K/V write and attention in one
    call); the model then uses it. The flags tell the model runner which per-step extras to build, once per step
    rather than once per layer.
    """

    name: str
    forward: AttentionFn
    rope_forward: RopeAttentionFn | None = None
    reads_decode_gather: bool = False  # decode_block_ids / decode_mask: the torch decode reference's gather indices
    reads_prefill_tables: bool = False  # prefill_tables: the kernels' block tables of the prefill chunks


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
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:  # [n, num_heads, head_dim]
    """A chunk attends to its cached prefix plus itself, causally. Query i sits at position num_cached + i."""
    n, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if chunk.context_slots is not None:
        key = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, chunk.context_slots)  # (ctx, kvh, hd)
        value = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, chunk.context_slots)
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


def _fresh_prefill_attention(
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
    meta: AttentionMetadata,
    decode_fn=paged_decode_attention,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """One layer's attention for a whole step: write the new K/V, then decodes in one call, prefill chunks after."""
    write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
    nd = meta.num_decode_tokens
    if not meta.prefills:
        return decode_fn(
            query, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.scale, meta.decode_block_ids,
            meta.decode_mask,
        )
    out = torch.empty_like(query)
    if nd:
        out[:nd] = decode_fn(
            query[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, meta.scale,
            meta.decode_block_ids, meta.decode_mask,
        )
    attend_prefills(out, query, key, value, k_cache, v_cache, meta)
    return out


def attend_prefills(
    out: torch.Tensor,  # [T, num_heads, head_dim], written at the prefill chunks' rows
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim], already written to the cache
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """The step's prefill chunks: runs of fresh equal-length chunks in one call, any other chunk alone."""
    for group in _prefill_groups(meta.prefills):
        first = group[0]
        span = slice(first.token_start, first.token_start + first.num_query_tokens * len(group))
        if len(group) > 1:
            out[span] = _fresh_prefill_attention(query[span], key[span], value[span], len(group), meta.scale)
        else:
            out[span] = prefill_attention(query[span], key[span], value[span], k_cache, v_cache, first, meta.scale)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in HF's non-interleaved layout: x * cos + rotate_half(x) * sin.  x: (T, heads, hd).

    ``sin_signed`` is ``[-sin_lo, sin_hi]``: rotate_half(x) * sin == swap_halves(x) * sin_signed, so the rotation is
    three ops; ``cos`` and ``sin_signed`` are (T, 1, hd), each token's rows of the tables.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # (T, heads, hd)
    return torch.addcmul(x * cos, swapped, sin_signed)


def rope_paged_attention(
    qkv: torch.Tensor,  # [T, (num_heads + 2 num_kv_heads) head_dim], the QKV projection's output
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_len, head_dim] the whole table
    sin_signed: torch.Tensor,  # [max_len, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    num_heads: int,
    attention_fn: AttentionFn = paged_attention,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """One layer's attention from its QKV projection: the rotary embedding on q and k, then ``attention_fn`` (which
    writes K/V and attends). The torch reference of the C kernel that does all of it in one call."""
    num_tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    num_kv_heads = k_cache.shape[2]
    qk_size = (num_heads + num_kv_heads) * head_dim
    rows = lambda table: table.index_select(0, positions)[:, None, :]  # noqa: E731  (T, 1, hd)
    qk = rotate(qkv[:, :qk_size].view(num_tokens, num_heads + num_kv_heads, head_dim), rows(cos), rows(sin_signed))
    value = qkv[:, qk_size:].view(num_tokens, num_kv_heads, head_dim)  # (T, kvh, hd)
    return attention_fn(qk[:, :num_heads], qk[:, num_heads:], value, k_cache, v_cache, meta)


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


# The torch reference: the plain path that every other backend is compared with.
TORCH_ATTENTION = AttentionBackend("torch", paged_attention, reads_decode_gather=True)
