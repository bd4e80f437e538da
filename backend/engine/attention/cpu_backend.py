"""Attention on the C kernels for CPUs (``backend.kernels.cpu_kernels``)."""

from __future__ import annotations

from backend.engine.attention.base import AttentionBackend
from backend.engine.attention.torch_backend import TorchAttention, attend_prefills
from backend.kernels import cpu_kernels


class CpuAttention(AttentionBackend):
    """One C call per layer rotates q and k, writes every token's K/V and attends the decodes, reading the pool in
    place through the block tables; the prefill chunks then attend in torch. Tensors the kernel does not take run
    the torch reference."""

    name = "cpu"

    def __init__(self) -> None:
        self._reference = TorchAttention()

    def forward(self, qkv, positions, cos, sin_signed, k_cache, v_cache, meta, num_heads):
        if not cpu_kernels.supports_rope_attention(qkv, positions, cos, sin_signed, meta.slot_mapping, k_cache,
                                                   v_cache, num_heads):
            return self._reference.forward(qkv, positions, cos, sin_signed, k_cache, v_cache, meta, num_heads)
        out = cpu_kernels.cpu_rope_paged_attention(
            qkv, positions, cos, sin_signed, meta.slot_mapping, k_cache, v_cache, meta.block_tables,
            meta.context_lens, meta.num_decode_tokens, meta.scale, num_heads,
        )  # (T, H, hd): the decodes' rows; q and k rotated in place in qkv, every token's K/V in the pool
        if meta.prefills:
            num_tokens, (num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape[2:]
            qk_size = (num_heads + num_kv_heads) * head_dim
            qk = qkv[:, :qk_size].view(num_tokens, num_heads + num_kv_heads, head_dim)
            value = qkv[:, qk_size:].view(num_tokens, num_kv_heads, head_dim)
            attend_prefills(out, qk[:, :num_heads], qk[:, num_heads:], value, k_cache, v_cache, meta.prefills,
                            meta.scale)
        return out
