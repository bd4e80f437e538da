"""Attention on the C kernels for CPUs (``backend.kernels.cpu_kernels``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.engine.attention.base import AttentionBackend, AttentionMetadata
from backend.engine.attention.torch_backend import TorchAttention, attend_prefills
from backend.kernels import cpu_kernels


@dataclass(frozen=True)
class CpuAttentionMetadata(AttentionMetadata):
    """The common metadata plus what the prefill kernel reads about the step's chunks (built once per step)."""

    prefill_plan: tuple[torch.Tensor, torch.Tensor] | None  # cpu_kernels.prefill_plan; None: no prefills or no kernel


class CpuAttention(AttentionBackend):
    """One C call per layer rotates q and k, writes every token's K/V and attends the decodes, reading the pool in
    place through the block tables; a second attends the prefill chunks (where the build has AVX512-BF16 or AVX2;
    else they attend in torch). Tensors the kernels do not take run the torch reference."""

    name = "cpu"

    def __init__(self, prefill_kernel: bool = True) -> None:
        self._reference = TorchAttention()
        self.prefill_kernel = prefill_kernel  # False: the chunks attend in torch (bench.prefill_attention's baseline)

    def build_metadata(self, common: AttentionMetadata) -> CpuAttentionMetadata:
        wanted = common.prefills and self.prefill_kernel and cpu_kernels.prefill_attention_available()
        plan = cpu_kernels.prefill_plan(common.prefills, common.slot_mapping) if wanted else None
        return common.extend(CpuAttentionMetadata, prefill_plan=plan)

    def forward(self, qkv, positions, cos, sin_signed, k_cache, v_cache, meta, num_heads):
        if not cpu_kernels.supports_rope_attention(qkv, positions, cos, sin_signed, meta.slot_mapping, k_cache,
                                                   v_cache, num_heads):
            return self._reference.forward(qkv, positions, cos, sin_signed, k_cache, v_cache, meta, num_heads)
        out = cpu_kernels.cpu_rope_paged_attention(
            qkv, positions, cos, sin_signed, meta.slot_mapping, k_cache, v_cache, meta.block_tables,
            meta.context_lens, meta.num_decode_tokens, meta.scale, num_heads,
        )  # (T, H, hd): the decodes' rows; q and k rotated in place in qkv, every token's K/V in the pool
        if not meta.prefills:
            return out
        if self.prefill_kernel and cpu_kernels.supports_prefill_attention(qkv, k_cache, v_cache, num_heads):
            plan = meta.prefill_plan if isinstance(meta, CpuAttentionMetadata) else None
            plan = plan or cpu_kernels.prefill_plan(meta.prefills, meta.slot_mapping)
            cpu_kernels.cpu_prefill_attention(out, qkv, k_cache, v_cache, plan, meta.scale, num_heads)
            return out
        num_tokens, (num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape[2:]
        qk_size = (num_heads + num_kv_heads) * head_dim
        qk = qkv[:, :qk_size].view(num_tokens, num_heads + num_kv_heads, head_dim)
        value = qkv[:, qk_size:].view(num_tokens, num_kv_heads, head_dim)
        attend_prefills(out, qk[:, :num_heads], qk[:, num_heads:], value, k_cache, v_cache, meta.prefills,
                        meta.scale)
        return out
