"""What every kernel wrapper needs: interpreter detection, the dot-product mode, small shape helpers, and the
online-softmax step over one tile of the paged KV cache that both attention kernels take."""

import torch
import triton
import triton.language as tl


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it then runs on CPU tensors, in numpy)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_device(kernel, *tensors: torch.Tensor) -> None:
    """Refuse, with a message a user can act on, tensors the kernel cannot read."""
    on_cpu = any(t.device.type == "cpu" for t in tensors)
    if on_cpu and not is_interpreted(kernel):
        raise ValueError(
            "OpenAI Triton kernels need CUDA tensors; to run them on CPU tensors (tests), set TRITON_INTERPRET=1 "
            "before backend.kernels is first imported"
        )


def dot_modes(kernel, dtype: torch.dtype) -> dict[str, bool]:
    """Constexpr flags that choose how ``tl.dot`` runs.

    IEEE_FP32: fp32 inputs use exact fp32 products, not TF32 (the fp32 engine must match HF's greedy tokens).
    UPCAST_DOT: the interpreter in triton 3.9 multiplies bf16/fp16 dot operands as their raw uint16 storage, so under
    it the operands are widened to fp32 first (after the same rounding to the cache dtype the GPU path does).
    """
    return {"IEEE_FP32": dtype == torch.float32, "UPCAST_DOT": is_interpreted(kernel) and dtype != torch.float32}


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(n))


@triton.jit
def mma(a, b, IEEE_FP32: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``a @ b`` accumulated in fp32, honouring the flags of :func:`dot_modes`."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE_FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def attend_kv_tile(
    q,  # (M, D) the program's query rows
    q_pos,  # (M,) each row's position in its sequence (CAUSAL only)
    m_i,  # (M,) fp32 running max (log2 domain)
    l_i,  # (M,) fp32 running sum of exponentials
    acc,  # (M, D) fp32 unnormalised output
    table,  # the sequence's block table
    tile_start,
    end,  # positions from `end` on are not read
    kv_head,
    block_size,
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, kvh, D]
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    qk_scale,  # softmax scale * log2(e)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    CAUSAL: tl.constexpr,  # row i sees positions <= q_pos[i] only
    IEEE_FP32: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One flash-attention step: the queries meet the K/V of positions ``tile_start .. tile_start + TILE_N - 1``
    (those below ``end``), each position finding its physical block through the block table, so a tile may span
    several KV blocks. Returns the updated ``(m_i, l_i, acc)``."""
    d = tl.arange(0, HEAD_DIM_PAD)
    pos = tile_start + tl.arange(0, TILE_N)
    valid = pos < end
    # NOTE: int64 before multiplying by the block stride: a large pool overflows int32 offsets.
    blocks = tl.load(table + pos // block_size, mask=valid, other=0).to(tl.int64)
    offset = pos % block_size
    kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]  # (N, D)
    k_rows = blocks * stride_kb + offset * stride_ks + kv_head * stride_kh
    k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (N, D)
    s = mma(q, tl.trans(k), IEEE_FP32, UPCAST_DOT) * qk_scale  # (M, N)
    visible = valid[None, :]
    if CAUSAL:
        # NOTE: position 0 is visible to every row, so each row's first tile holds a finite score.
        visible = visible & (pos[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_rows = blocks * stride_vb + offset * stride_vs + kv_head * stride_vh
    v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)  # (N, D)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, IEEE_FP32, UPCAST_DOT)
    return m_new, l_i, acc
