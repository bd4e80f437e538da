"""Weight-only quantized projections on CPUs: the bytes of the quantized weight formats (named by
:class:`~backend.kernels.weight_format.WeightFormat`), their torch twins, and the C kernels.

A quantized weight is one uint8 tensor ``[N, row_bytes]`` (``cpu/linear_quant.c``):

- ``q4_1``: GGUF's Q4_1 blocks as llama.cpp reads them: per 32 weights an fp16 scale d, an fp16 min m and 16 bytes
  of nibbles; w = d * q + m. Held with the rows in groups of 16 (:func:`group_rows`; the rows past the last whole
  group as GGUF's): a block of the group's 16 rows is their 16 (d, m) pairs, then their nibbles 4 bytes of each row
  at a time, so that one 64-byte load feeds an integer dot product for 16 outputs. The bytes are GGUF's, reordered.
- ``q8_0``: GGUF's Q8_0 blocks (the shipped Q4_1 file holds its token embedding, so its tied LM head, in Q8_0):
  per 32 weights an fp16 scale d and 32 int8; w = d * q.
- ``int8``: per output channel: K int8, then the row's float32 scale s; w = s * q (rows self-contained, as q8_0's).

:func:`cpu_quantized_linear` (a decode step's rows) and :func:`quantized_linear_reference` take the same
arguments and give the same result within the order of a float32 sum, the twin computing what this build's kernel
computes for that many rows (:func:`kernel_path`): by default both widen each weight to float32 exactly and meet it
with x widened to float32, then apply the op and round once. Where the build has AVX512-VNNI (``x_int8``), q4_1 (and
q8_0 where the CPU has no AMX) meets x quantized to int8 per block of 32, as llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0
do, and sums the weights' products with x's in integers; the twin then quantizes x the same way
(:func:`quantize_x_q8`). Where it has AMX (``bf16_tiles``, a few
rows and more), each weight is widened to bf16 (rounded once, the prefill's widened weight) and met with x on AMX
tiles, a panel of weights at a time, so the weights are widened once for all the rows.
:func:`cpu_dequantize` (the prefill's many rows, which then run the bf16 matmuls) equals
``dequantize(...).to(torch.bfloat16)`` to the bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.kernels import cpu_kernels
from backend.kernels.weight_format import WeightFormat

Q4_1, Q8_0, INT8 = WeightFormat.Q4_1, WeightFormat.Q8_0, WeightFormat.INT8  # the formats held here, by short names
# NOTE: one more whenever a format's held bytes change (2: q4_1's rows in groups); files of prepared weights are
# keyed by it, so none made before is read with the new meaning
HELD_LAYOUT_VERSION = 2
_BLOCK = {Q4_1: 32, INT8: 16, Q8_0: 32}  # K must be a multiple of this
_KERNELS = {Q4_1: "linear_q4_1", INT8: "linear_int8", Q8_0: "linear_q8_0"}


def row_bytes(fmt: WeightFormat, k: int) -> int:
    """Bytes of one output row of K weights in ``fmt``."""
    return {Q4_1: k // 32 * 20, Q8_0: k // 32 * 34, INT8: k + 4}[fmt]


def in_features(fmt: WeightFormat, num_row_bytes: int) -> int:
    """K of a weight whose rows are ``num_row_bytes`` long."""
    return {Q4_1: num_row_bytes // 20 * 32, Q8_0: num_row_bytes // 34 * 32, INT8: num_row_bytes - 4}[fmt]


_GROUP = 16  # q4_1's rows per group


def group_rows(fmt: WeightFormat, rows: torch.Tensor) -> torch.Tensor:  # [N, row_bytes] uint8
    """GGUF's rows (``[N, row_bytes]``) as ``fmt`` holds them: q4_1's in groups of 16 (see the module's docstring),
    the others as they are."""
    if fmt != Q4_1 or rows.shape[0] < _GROUP:
        return rows
    n, nb = rows.shape[0] // _GROUP * _GROUP, rows.shape[1] // 20
    blocks = rows[:n].reshape(n // _GROUP, _GROUP, nb, 20)  # (G, 16 rows, nb, bytes)
    dm = blocks[..., :4].permute(0, 2, 1, 3).reshape(n // _GROUP, nb, 64)  # (G, nb, 16 rows x 4)
    qs = blocks[..., 4:].reshape(n // _GROUP, _GROUP, nb, 4, 4).permute(0, 2, 3, 1, 4)  # (G, nb, v, 16 rows, 4)
    grouped = torch.cat([dm, qs.reshape(n // _GROUP, nb, 256)], dim=2).reshape(n, -1)
    return torch.cat([grouped, rows[n:]])


def ungroup_rows(fmt: WeightFormat, weight: torch.Tensor) -> torch.Tensor:  # [N, row_bytes] uint8
    """The inverse of :func:`group_rows`: GGUF's rows, each self-contained."""
    if fmt != Q4_1 or weight.shape[0] < _GROUP:
        return weight
    n, nb = weight.shape[0] // _GROUP * _GROUP, weight.shape[1] // 20
    units = weight[:n].reshape(n // _GROUP, nb, 320)
    dm = units[..., :64].reshape(n // _GROUP, nb, _GROUP, 4).permute(0, 2, 1, 3)  # (G, 16 rows, nb, 4)
    qs = units[..., 64:].reshape(n // _GROUP, nb, 4, _GROUP, 4).permute(0, 3, 1, 2, 4)  # (G, 16 rows, nb, v, 4)
    rows = torch.cat([dm, qs.reshape(n // _GROUP, _GROUP, nb, 16)], dim=3).reshape(n, -1)
    return torch.cat([rows, weight[n:]])


def gguf_rows(fmt: WeightFormat, weight: torch.Tensor,
              rows: torch.Tensor) -> torch.Tensor:  # [len(rows), row_bytes] uint8
    """Rows ``rows`` of a held weight as GGUF's, each self-contained: only the groups they are in are read back (a
    tied embedding looks up a step's tokens in the LM head's weight)."""
    if fmt != Q4_1 or weight.shape[0] < _GROUP:
        return weight.index_select(0, rows)
    whole = weight.shape[0] // _GROUP * _GROUP
    in_groups = rows.clamp(max=whole - 1)  # rows past the last whole group are read as they are, below
    groups = weight[:whole].reshape(whole // _GROUP, _GROUP, -1).index_select(0, in_groups // _GROUP)
    ungrouped = ungroup_rows(fmt, groups.reshape(-1, weight.shape[1])).reshape(len(rows), _GROUP, -1)
    picked = ungrouped[torch.arange(len(rows)), in_groups % _GROUP]
    return torch.where((rows < whole)[:, None], picked, weight.index_select(0, rows))


def fits(fmt: WeightFormat, k: int) -> bool:
    """Whether ``fmt`` holds rows of ``k`` weights (whole blocks)."""
    return k > 0 and k % _BLOCK[fmt] == 0


def quantize(fmt: WeightFormat, weight: torch.Tensor) -> torch.Tensor:  # [N, row_bytes] uint8
    """``weight`` [N, K] in ``fmt`` as held, rounded as llama.cpp's reference quantizers (``quantize_row_q4_1_ref``,
    ``quantize_row_q8_0_ref``) round; ``int8`` scales each row by its largest magnitude / 127."""
    w = weight.float()
    n, k = w.shape
    if not fits(fmt, k):
        raise ValueError(f"{fmt} holds rows of a multiple of {_BLOCK[fmt]} weights; got {k}")
    if fmt == INT8:
        scale = w.abs().amax(dim=1, keepdim=True) / 127  # (N, 1)
        q = torch.round(w / torch.where(scale > 0, scale, 1)).clamp(-127, 127).to(torch.int8)
        return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1)
    blocks = w.view(n, k // 32, 32)
    if fmt == Q4_1:
        lo, hi = blocks.amin(dim=2, keepdim=True), blocks.amax(dim=2, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, 0)
        q = torch.clamp(((blocks - lo) * inv + 0.5).to(torch.uint8), max=15)  # truncation of x + 0.5, as ggml
        nibbles = q[:, :, :16] | (q[:, :, 16:] << 4)  # (N, K/32, 16)
        head = torch.cat([d, lo], dim=2).to(torch.float16).view(torch.uint8)  # (N, K/32, 4)
        return group_rows(fmt, torch.cat([head, nibbles], dim=2).reshape(n, -1))
    amax = blocks.abs().amax(dim=2, keepdim=True)
    d = amax / 127
    q = torch.round(blocks * torch.where(d > 0, 1 / d, 0)).to(torch.int8)  # roundf, as ggml
    return torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=2).reshape(n, -1)


def dequantize(fmt: WeightFormat, weight: torch.Tensor) -> torch.Tensor:  # [N, K] float32
    """The weights a quantized tensor holds, each widened to float32 exactly as the C kernels widen it."""
    weight = ungroup_rows(fmt, weight)
    n = weight.shape[0]
    if fmt == INT8:
        k = weight.shape[1] - 4
        scale = weight[:, k:].contiguous().view(torch.float32)  # (N, 1)
        return weight[:, :k].view(torch.int8).float() * scale
    blocks = weight.reshape(n, -1, 20 if fmt == Q4_1 else 34)  # (N, K/32, bytes)
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).float()  # (N, K/32, 1)
    if fmt == Q4_1:
        m = blocks[:, :, 2:4].contiguous().view(torch.float16).float()
        qs = blocks[:, :, 4:]  # (N, K/32, 16)
        q = torch.cat([qs & 15, qs >> 4], dim=2).float()  # (N, K/32, 32)
        return (d * q + m).reshape(n, -1)  # NOTE: d * q is exact in float32, so this is one rounding, as an fma
    q = blocks[:, :, 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(n, -1)


KERNEL_PATHS = ("float32", "x_int8", "bf16_tiles")  # quant_kernel_path's codes (linear_quant.c)


def kernel_path(fmt: WeightFormat, num_rows: int, k: int, n: int) -> str:
    """How this build's kernel computes ``num_rows`` rows against an [n, k] weight of ``fmt`` (see the module's
    docstring): ``float32``, ``x_int8`` or ``bf16_tiles``; ``float32`` without the C kernels."""
    lib = cpu_kernels.load()
    return "float32" if lib is None else KERNEL_PATHS[lib.quant_kernel_path(fmt.c_code, num_rows, k, n)]


def quantize_x_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] per block of 32 as the VNNI kernel quantizes it: q [T, K/32, 32] (integers, as float32),
    dx [T, K/32, 1] (amax / 127) and sx [T, K/32, 1] (dx * sum(q), llama.cpp's Q8_1 sum)."""
    blocks = x.float().view(x.shape[0], -1, 32)
    dx = blocks.abs().amax(dim=2, keepdim=True) * torch.tensor(1 / 127, dtype=torch.float32)
    q = torch.round(blocks * torch.where(dx > 0, 1 / dx, 0))  # nearest even, as the kernel's lrintf
    return q, dx, dx * q.sum(dim=2, keepdim=True)


def x_int8_terms(fmt: WeightFormat, x: torch.Tensor,
                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-block terms of the VNNI kernel's sums, each [T, N, K/32] float32: (d dx) * sum(q_w q_x), and q4_1's
    m sx (None for q8_0, which has no mins)."""
    q, dx, sx = quantize_x_q8(x)  # (T, nb, 32), (T, nb, 1) x2
    n = weight.shape[0]
    blocks = ungroup_rows(fmt, weight).reshape(n, -1, 20 if fmt == Q4_1 else 34)
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).float()[..., 0]  # (N, nb)
    if fmt == Q4_1:
        qs = blocks[:, :, 4:]
        qw = torch.cat([qs & 15, qs >> 4], dim=2).double()  # (N, nb, 32)
    else:
        qw = blocks[:, :, 2:].contiguous().view(torch.int8).double()  # (N, nb, 32)
    dots = torch.einsum("tbk,nbk->tnb", q.double(), qw).float()  # exact integers
    scaled = (d[None] * dx[:, None, :, 0]) * dots
    if fmt != Q4_1:
        return scaled, None
    m = blocks[:, :, 2:4].contiguous().view(torch.float16).float()[..., 0]
    return scaled, m[None] * sx[:, None, :, 0]


def quantized_linear_reference(
    fmt: WeightFormat,
    x: torch.Tensor,  # [T, K] bf16
    weight: torch.Tensor,  # [N, row_bytes] uint8 in fmt
    bias: torch.Tensor | None = None,  # [N] bf16
    op: str = "none",  # then silu, or times / plus ``other``
    other: torch.Tensor | None = None,  # [T, N] bf16
) -> torch.Tensor:  # [T, N] bf16
    """The torch twin of :func:`cpu_quantized_linear`: float32 sums, the op on them, one rounding to bf16."""
    path = kernel_path(fmt, x.shape[0], x.shape[1], weight.shape[0])
    if path == "x_int8":
        y = sum(term.double().sum(dim=2) for term in x_int8_terms(fmt, x, weight) if term is not None).float()  # (T, N)
    elif path == "bf16_tiles":
        y = x.float() @ dequantize(fmt, weight).to(torch.bfloat16).float().T  # (T, N)
    else:
        y = x.float() @ dequantize(fmt, weight).T  # (T, N)
    if bias is not None:
        y = y + bias.float()
    if op == "silu":
        y = F.silu(y)
    elif op == "mul":
        y = y * other.float()
    elif op == "add":
        y = y + other.float()
    return y.to(torch.bfloat16)


def supports(fmt: WeightFormat, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`cpu_quantized_linear` takes these tensors (else the caller runs the twin)."""
    lib_limits = cpu_kernels.limits()
    k = in_features(fmt, weight.shape[1])
    return (lib_limits is not None and x.device.type == weight.device.type == "cpu" and x.dtype == torch.bfloat16
            and x.dim() == 2 and x.shape[1] == k and x.stride(-1) == 1 and weight.dtype == torch.uint8
            and weight.is_contiguous() and fits(fmt, k) and k <= lib_limits.linear_max_k)


def cpu_quantized_linear(
    fmt: WeightFormat,
    x: torch.Tensor,  # [T, K] bf16, rows may be strided
    weight: torch.Tensor,  # [N, row_bytes] uint8 in fmt
    bias: torch.Tensor | None = None,  # [N] bf16
    op: str = "none",
    other: torch.Tensor | None = None,  # [T, N] bf16, rows may be strided
) -> torch.Tensor:  # [T, N] bf16
    """``op(x @ W.T + bias)`` with W quantized, in C (``linear_q4_1``, ``linear_int8``, ``linear_q8_0``)."""
    if not supports(fmt, x, weight) or (other is not None and other.stride(-1) != 1):
        raise ValueError(f"{_KERNELS[fmt]} cannot take these tensors; run quantized_linear_reference")
    lib = cpu_kernels.load()
    (num_rows, k), n = x.shape, weight.shape[0]
    out = torch.empty((num_rows, n), dtype=torch.bfloat16)
    if num_rows == 0:
        return out
    other_ptr, other_stride = (None, 0) if other is None else (other.data_ptr(), other.stride(0))
    status = getattr(lib, _KERNELS[fmt])(
        x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(), num_rows, k, n,
        cpu_kernels.LINEAR_OPS[op], other_ptr, other_stride, out.data_ptr(), torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"{_KERNELS[fmt]} cannot take {num_rows} rows of {k}")
    return out


def cpu_dequantize(fmt: WeightFormat, weight: torch.Tensor) -> torch.Tensor:  # [N, K] bf16
    """The C twin of ``dequantize(fmt, weight).to(torch.bfloat16)``."""
    lib = cpu_kernels.load()
    k = in_features(fmt, weight.shape[1])
    if lib is None or weight.dtype != torch.uint8 or not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError("dequantize_weight cannot take this tensor; run dequantize")
    out = torch.empty((weight.shape[0], k), dtype=torch.bfloat16)
    if lib.dequantize_weight(fmt.c_code, weight.data_ptr(), weight.shape[0], k, out.data_ptr(),
                             torch.get_num_threads()) != 0:
        raise ValueError(f"dequantize_weight cannot take rows of {k} weights in {fmt}")
    return out
