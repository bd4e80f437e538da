"""Attention on the OpenAI Triton kernels for CUDA (``backend/kernels``): K/V write, decode and (chunked) prefill.

Imported only where a GPU is used (``select_attention_backend``), so the CPU path never imports ``triton``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.engine.attention.base import AttentionBackend, AttentionMetadata, PrefillChunk
from backend.engine.attention.torch_backend import rope_qkv
from backend.kernels.decode_attention import cuda_decode_attention
from backend.kernels.prefill_attention import paged_prefill_attention
from backend.kernels.reshape_and_cache import cuda_write_kv


@dataclass(frozen=True)
class PrefillTables:
    """The step's prefill chunks as the prefill kernel reads them (on the device), built once per step."""

    block_tables: torch.Tensor  # [C, max_blocks] int32, padded with 0 (never read past a chunk's context)
    query_starts: torch.Tensor  # [C] int32: each chunk's first token in the step's stream
    query_lens: torch.Tensor  # [C] int32
    num_cached: torch.Tensor  # [C] int32
    max_query_len: int  # host-side bound on query_lens: sizes the kernel's grid without a device sync

    @classmethod
    def build(cls, prefills: tuple[PrefillChunk, ...], device: torch.device) -> PrefillTables:
        width = max(len(c.block_ids) for c in prefills)
        tables = torch.tensor([list(c.block_ids) + [0] * (width - len(c.block_ids)) for c in prefills],
                              dtype=torch.int32)  # (C, max_blocks)
        starts_lens_cached = torch.tensor(
            [[c.token_start for c in prefills], [c.num_query_tokens for c in prefills],
             [c.num_cached_tokens for c in prefills]], dtype=torch.int32,
        )  # (3, C)
        tables, (starts, lens, cached) = tables.to(device), starts_lens_cached.to(device)
        return cls(tables, starts, lens, cached, max(c.num_query_tokens for c in prefills))


@dataclass(frozen=True)
class TritonAttentionMetadata(AttentionMetadata):
    prefill_tables: PrefillTables | None  # None without prefill chunks


class TritonAttention(AttentionBackend):
    """The rotary embedding in torch, then the K/V write, all decodes in one launch and all prefill chunks in one
    launch, each kernel writing straight into one output tensor."""

    name = "triton"

    def build_metadata(self, common: AttentionMetadata) -> TritonAttentionMetadata:
        tables = PrefillTables.build(common.prefills, common.slot_mapping.device) if common.prefills else None
        return common.extend(TritonAttentionMetadata, prefill_tables=tables)

    def forward(self, qkv, positions, cos, sin_signed, k_cache, v_cache, meta: TritonAttentionMetadata, num_heads):
        query, key, value = rope_qkv(qkv, positions, cos, sin_signed, num_heads, k_cache.shape[2])
        cuda_write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
        out = torch.empty_like(query)  # (T, H, hd)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            cuda_decode_attention(query[:num_decodes], k_cache, v_cache, meta.block_tables, meta.context_lens,
                                  meta.scale, out=out[:num_decodes])
        if meta.prefills:
            t = meta.prefill_tables
            paged_prefill_attention(
                query, k_cache, v_cache, t.block_tables, t.query_starts, t.query_lens, t.num_cached, meta.scale,
                t.max_query_len, out,
            )
        return out
