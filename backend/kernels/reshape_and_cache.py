"""Write the step's new K/V into their slots of the paged pool (vLLM's reshape-and-cache)."""

import torch
import triton
import triton.language as tl

from backend.kernels._common import check_device, pow2


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, kvh, D]
    value_ptr,
    k_cache_ptr,  # [num_blocks, block_size, kvh, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int64
    block_size,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    # NOTE: a negative slot (padding in callers that pad) is skipped rather than written out of bounds. The slot is
    # broadcast to a row before the test: the interpreter rejects a mask built from a scalar condition.
    in_pool = (tl.zeros([HEADS_PAD], tl.int64) + slot) >= 0
    mask = (in_pool & (h < NUM_KV_HEADS))[:, None] & (d < HEAD_DIM)[None, :]  # (kvh, D)
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch + d[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# NOTE: the torch reference's write_kv signature, on purpose: a kernel and its twin take the same inputs.
def cuda_write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
) -> None:
    """The kernel twin of the torch reference's ``write_kv``: store token t's K/V at flat slot ``slot_mapping[t]``."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    check_device(_write_kv_kernel, key, k_cache)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's last dimension must be contiguous")
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=pow2(num_kv_heads), HEAD_DIM=head_dim, HEAD_DIM_PAD=pow2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 256 else 4,
    )
