"""One layer's attention for a whole step on the GPU: the kernel twin of ``backend.attention.paged_attention``."""

import torch

from backend.attention import AttentionMetadata
from backend.kernels.decode_attention import cuda_decode_attention
from backend.kernels.prefill_attention import block_table_from_slots, paged_prefill_attention
from backend.kernels.reshape_and_cache import cuda_write_kv


def cuda_paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    decode_fn=cuda_decode_attention,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Write the new K/V, then all decodes in one launch and all prefill chunks in one launch.

    Same inputs and result as the torch ``paged_attention``; the kernels write straight into one output tensor.
    """
    cuda_write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
    out = torch.empty_like(query)
    nd = meta.num_decode_tokens
    if nd:
        args = (query[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, meta.scale)
        if decode_fn is cuda_decode_attention:
            cuda_decode_attention(*args, out=out[:nd])
        else:
            out[:nd] = decode_fn(*args, meta.decode_slots, meta.decode_mask)
    if meta.prefills:
        _prefill(query, k_cache, v_cache, meta, out)
    return out


def _prefill(query, k_cache, v_cache, meta: AttentionMetadata, out: torch.Tensor) -> None:
    block_size = k_cache.shape[1]
    tables = []
    for chunk in meta.prefills:
        # A chunk with nothing cached starts at position 0, so its own slots give its blocks.
        span = slice(chunk.token_start, chunk.token_start + chunk.num_query_tokens)
        slots = chunk.context_slots if chunk.context_slots is not None else meta.slot_mapping[span]
        tables.append(block_table_from_slots(slots, block_size))
    block_tables = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)  # (C, max_blocks), padded with 0
    starts, lens, cached = torch.tensor(
        [[c.token_start, c.num_query_tokens, c.num_cached_tokens] for c in meta.prefills], dtype=torch.int32
    ).T.contiguous().to(query.device)  # (3, C)
    max_query_len = max(c.num_query_tokens for c in meta.prefills)
    paged_prefill_attention(query, k_cache, v_cache, block_tables, starts, lens, cached, meta.scale, max_query_len, out)
