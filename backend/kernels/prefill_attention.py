"""Prefill and chunked-prefill attention over the paged KV cache, for many chunks in one launch.

A chunk of ``n`` query tokens of one sequence attends to the ``num_cached`` tokens already in the cache plus itself,
causally: query ``i`` sits at position ``num_cached + i`` and sees positions ``0 .. num_cached + i``. All keys and
values (the chunk's own included, written just before) are read from the paged cache through the chunk's block
table, tile by tile with an online softmax (flash-attention), so no copy of the context is ever gathered.

The grid is (query tiles of ``BLOCK_M`` rows, query heads, chunks); a program whose tile lies past its chunk's end does
nothing. Each program serves one query head: prefill is bound by compute, and the K/V tiles that the heads of one
group share come from L2.
"""

import math

import torch
import triton
import triton.language as tl

from backend.kernels._common import attend_kv_tile, check_device, dot_modes, pow2

BLOCK_M = 64  # query rows per program
BLOCK_N = 64  # context positions per inner-loop iteration


# NOTE: the paged pool's arguments are _decode_kernel's, in its order: both hand them to attend_kv_tile as they come.
@triton.jit
def _prefill_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, kvh, D]
    v_cache_ptr,
    block_tables_ptr,  # [C, max_blocks] int32
    query_starts_ptr,  # [C] int32: first row of each chunk in q/out
    query_lens_ptr,  # [C] int32
    num_cached_ptr,  # [C] int32
    qk_scale,  # softmax scale * log2(e)
    block_size,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_starts_ptr + chunk)
    q_len = tl.load(query_lens_ptr + chunk)
    num_cached = tl.load(num_cached_ptr + chunk)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    row_mask = (rows < q_len)[:, None] & (d < HEAD_DIM)[None, :]  # (M, D)
    q_rows = (q_start + rows).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_mask, other=0.0)  # (M, D)
    q_pos = num_cached + rows  # (M,) position of each query in its sequence
    # The last position any row of this tile may see; 0 (no work) for a tile past the chunk's end.
    kv_end = tl.minimum(num_cached + q_len, num_cached + (tile + 1) * BLOCK_M)
    kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + chunk.to(tl.int64) * stride_bt
    for tile_start in range(0, kv_end, BLOCK_N):
        m_i, l_i, acc = attend_kv_tile(
            q, q_pos, m_i, l_i, acc, table, tile_start, kv_end, kv_head, block_size,
            k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, True, IEEE_FP32, UPCAST_DOT,
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only in a tile past the chunk's end (not stored)
    o_rows = (q_start + rows).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]: rows of all chunks (other rows are left untouched)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [C, max_blocks] int32, covering num_cached + query_len positions per chunk
    query_starts: torch.Tensor,  # [C] int32: each chunk's first row in query
    query_lens: torch.Tensor,  # [C] int32
    num_cached: torch.Tensor,  # [C] int32
    scale: float,
    max_query_len: int,  # host-side bound on query_lens (sizes the grid without a device sync)
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]; written only at the chunks' rows
) -> torch.Tensor:
    """Causal attention of C chunks to their cached prefix plus themselves, read through their block tables."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(query)
    num_chunks = block_tables.shape[0]
    if num_chunks == 0 or max_query_len == 0:
        return out
    check_device(_prefill_kernel, query, k_cache)
    query, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, k_cache, v_cache))
    block_tables = block_tables.to(torch.int32).contiguous()
    grid = (triton.cdiv(max_query_len, BLOCK_M), num_heads, num_chunks)
    _prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables,
        *(t.to(torch.int32).contiguous() for t in (query_starts, query_lens, num_cached)),
        scale * math.log2(math.e), k_cache.shape[1],
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=pow2(head_dim, 16),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, **dot_modes(_prefill_kernel, query.dtype),
        num_warps=4,
        num_stages=2 if query.dtype == torch.float32 else 3,  # fp32 K/V tiles are twice the shared memory
    )
    return out

