"""One layer's attention for a whole step on the GPU: the kernel twin of ``backend.engine.attention.paged_attention``."""

import torch

from backend.engine.attention import AttentionBackend, AttentionMetadata, PrefillTables
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
    The chunks' block tables come from ``meta.prefill_tables`` (built once per step by the model runner), else from
    the chunks' slots.
    """
    cuda_write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
    out = torch.empty_like(query)
    nd = meta.num_decode_tokens
    if nd:
        args = (query[:nd], k_cache, v_cache, meta.block_tables, meta.context_lens, meta.scale)
        if decode_fn is cuda_decode_attention:
            cuda_decode_attention(*args, out=out[:nd])
        else:
            out[:nd] = decode_fn(*args, meta.decode_block_ids, meta.decode_mask)
    if meta.prefills:
        t = meta.prefill_tables or prefill_tables_from_slots(meta, k_cache.shape[1])
        paged_prefill_attention(
            query, k_cache, v_cache, t.block_tables, t.query_starts, t.query_lens, t.num_cached, meta.scale,
            t.max_query_len, out,
        )
    return out


def prefill_tables_from_slots(meta: AttentionMetadata, block_size: int) -> PrefillTables:
    """The prefill chunks' block tables recovered from their slots (for metadata built without them)."""
    tables = []
    for chunk in meta.prefills:
        # A chunk with nothing cached starts at position 0, so its own slots give its blocks.
        span = slice(chunk.token_start, chunk.token_start + chunk.num_query_tokens)
        slots = chunk.context_slots if chunk.context_slots is not None else meta.slot_mapping[span]
        tables.append(block_table_from_slots(slots, block_size))
    block_tables = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)  # (C, max_blocks), padded with 0
    return PrefillTables.build(meta.prefills, block_tables)


# The step's attention on the kernels: KV write, decode and (chunked) prefill.
TRITON_ATTENTION = AttentionBackend("triton", cuda_paged_attention, reads_prefill_tables=True)
