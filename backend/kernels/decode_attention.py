"""Decode attention over the paged KV cache: one query token per sequence, grouped-query, online softmax.

One program handles one (sequence, KV head) pair and all the query heads that share that KV head, so each K/V tile is
read from memory once per group. Query heads are padded to 16 rows, the smallest ``tl.dot`` operand on tensor cores;
decode is bound by memory, so the padded rows cost no bandwidth. The context is read in tiles of ``TILE_N`` positions,
each position finding its physical block through the block table, so a tile may span several KV blocks.

For few sequences with long contexts (too few programs to fill the GPU) the context is split into ``num_splits``
ranges, each program writes an unnormalised partial result with its running max and sum, and a second kernel merges
them (flash-decoding). With ``num_splits == 1`` the first kernel writes the final output directly.
"""

import math

import torch
import triton
import triton.language as tl

from backend.kernels._common import attend_kv_tile, check_device, dot_modes, pow2

TILE_N = 64  # context positions per inner-loop iteration
MIN_TOKENS_PER_SPLIT = 256  # a split shorter than this costs more to merge than it gains


@triton.jit
def _decode_kernel(
    out_ptr,  # [B, H, D], or with SPLIT the fp32 partial accumulators [B, H, S, D]
    max_ptr,  # [B, H, S] fp32 running max (log2 domain), SPLIT only
    sum_ptr,  # [B, H, S] fp32 running sum of exponentials, SPLIT only
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, kvh, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    qk_scale,  # softmax scale * log2(e): the kernel works with exp2
    tokens_per_split,
    num_splits,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(context_len, start + tokens_per_split)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g
    head_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]  # (GP, D)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=head_mask, other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, TILE_N):
        m_i, l_i, acc = attend_kv_tile(
            q, 0, m_i, l_i, acc, table, tile_start, end, kv_head, BLOCK_SIZE,
            k_cache_ptr, v_cache_ptr, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
            HEAD_DIM, HEAD_DIM_PAD, TILE_N, False, IEEE_FP32, UPCAST_DOT,
        )

    if SPLIT:
        num_heads = tl.num_programs(1) * GROUP
        row = (seq * num_heads + heads) * num_splits + split  # index of (b, h, s) in [B, H, S]
        tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=head_mask)
        tl.store(max_ptr + row, m_i, mask=g < GROUP)
        tl.store(sum_ptr + row, l_i, mask=g < GROUP)
    else:
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [B, H, D]
    acc_ptr,  # [B, H, S, D] fp32
    max_ptr,  # [B, H, S]
    sum_ptr,  # [B, H, S]
    num_heads,
    num_splits,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    rows = (seq * num_heads + head) * num_splits + s
    used = s < num_splits
    m = tl.load(max_ptr + rows, mask=used, other=float("-inf"))  # empty splits hold -inf
    sums = tl.load(sum_ptr + rows, mask=used, other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))  # (S,): 0 for empty splits
    mask = used[:, None] & (d < HEAD_DIM)[None, :]
    acc = tl.load(acc_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)  # (S, D)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(sums * weight, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def cuda_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
    slots: torch.Tensor | None = None,  # unused: the torch path's gather indices
    mask: torch.Tensor | None = None,  # unused
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [B, num_heads, head_dim] with a contiguous last dimension, e.g. a row slice
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """The kernel twin of the torch reference's ``paged_decode_attention`` (same inputs, same result).

    ``num_splits=None`` picks the split count from the batch, the context bound and the GPU's SM count; the context
    bound is ``max_blocks * block_size`` (no device sync on ``context_lens``).
    """
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    check_device(_decode_kernel, query, k_cache)
    query, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, k_cache, v_cache))
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    group = num_heads // num_kv_heads
    max_context = max(block_tables.shape[1], 1) * block_size
    if num_splits is None:
        num_splits = _auto_num_splits(batch * num_kv_heads, max_context, query.device)
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, max(num_splits, 1)), TILE_N) * TILE_N
    num_splits = max(1, triton.cdiv(max_context, tokens_per_split))
    split = num_splits > 1
    if split:
        partial = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        maxes = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
        sums = torch.empty_like(maxes)
        target = partial
    else:
        target = maxes = sums = out  # the max/sum pointers go unused
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        target, maxes, sums, query, k_cache, v_cache, block_tables, context_lens,
        scale * math.log2(math.e), tokens_per_split, num_splits,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=pow2(group, 16), HEAD_DIM=head_dim, HEAD_DIM_PAD=pow2(head_dim, 16),
        BLOCK_SIZE=block_size, TILE_N=TILE_N, SPLIT=split, **dot_modes(_decode_kernel, query.dtype),
        num_warps=4,
        num_stages=2 if query.dtype == torch.float32 else 3,  # fp32 K/V tiles are twice the shared memory
    )
    if split:
        _merge_splits_kernel[(batch, num_heads)](
            out, partial, maxes, sums, num_heads, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=pow2(head_dim, 16), SPLITS_PAD=pow2(num_splits),
        )
    return out


def _auto_num_splits(num_programs: int, max_context: int, device: torch.device) -> int:
    """Split the context only when (sequence, KV head) programs alone would leave most SMs idle."""
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * num_sms, num_programs)
    return max(1, min(wanted, max_context // MIN_TOKENS_PER_SPLIT, 64))
