"""The model's fast path on a CPU: which kernel runs a projection of how many rows, the weight layouts each reads,
the RMSNorm kernel, and the decode stack (every layer of a small decode step in one C call).

One routing function, :func:`route`, sends each projection to a kernel by its row count; the decode stack takes a step
exactly where that sends every projection to C. On CUDA, in float32, or without the C kernels, every projection is the
plain ``F.linear`` and its elementwise op (the reference path). The figures behind the row limits are in
``docs/cpu-kernels.md``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from backend.engine.attention import AttentionBackend, AttentionMetadata, CpuAttention
from backend.engine.config import ModelShape
from backend.kernels import cpu_kernels

# Up to this many rows a bf16 projection streams its weight through linear_small once, faster than oneDNN's matmul;
# above it the step is compute-bound and oneDNN's AMX matmuls win.
SMALL_BATCH_ROWS = 8
# Where the CPU has AMX, linear_amx is faster than linear_small from 2 rows on, and than oneDNN up to the rows the
# library takes (cpu_kernels.limits().linear_max_rows).
SMALL_BATCH_ROWS_WITH_AMX = 1


class Kernel(enum.Enum):
    C_SMALL = "cpu_linear_small"
    C_AMX = "cpu_linear_amx"
    ONEDNN = "onednn"  # torch's mkldnn linear with the weight in oneDNN's blocked layout
    TORCH = "torch"  # F.linear, then the elementwise op: the reference


def small_rows_limit(has_amx: bool) -> int:
    """The most rows ``cpu_linear_small`` takes: fewer where ``cpu_linear_amx`` is there to take the rest."""
    return SMALL_BATCH_ROWS_WITH_AMX if has_amx else SMALL_BATCH_ROWS


def c_rows_limit(has_amx: bool) -> int:
    """The most rows a projection runs in C: ``cpu_linear_amx`` takes up to the library's limit."""
    return _library_max_rows() if has_amx else SMALL_BATCH_ROWS


@functools.cache
def _library_max_rows() -> int:
    return cpu_kernels.limits().linear_max_rows


def route(num_rows: int, linear: Linear) -> Kernel:
    """The kernel that runs ``linear`` over ``num_rows`` rows: the one place this is decided."""
    has_amx = linear.amx_weight is not None
    if linear.small_weight is not None and num_rows <= small_rows_limit(has_amx):
        return Kernel.C_SMALL
    if has_amx and num_rows <= c_rows_limit(True):
        return Kernel.C_AMX
    return Kernel.TORCH if linear.onednn_weight is None else Kernel.ONEDNN


class Linear:
    """``op(x @ weight.T + bias)``, op one of none, silu, ``* other`` or ``+ other`` (the elementwise work that
    follows a matmul in a decoder layer, fused where the kernel allows: on the float32 sum, one rounding).

    The weight is laid out once at load time for each kernel that may run it (:func:`route` picks per call): oneDNN's
    blocked layout (a plain ``F.linear`` on CPU re-lays the weight out on every call), and, for bf16 on CPU,
    ``cpu_linear_small``'s and ``cpu_linear_amx``'s copies.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:  # weight (out, in)
        self.bias = bias
        self.onednn_weight = _onednn_pack(weight)
        self.weight = weight if self.onednn_weight is None else None  # the packed copy replaces it
        self.small_weight = cpu_kernels.prepare_linear_weight(weight)  # None off CPU bf16 or without the C kernels
        self.amx_weight = cpu_kernels.prepare_linear_weight_amx(weight)  # None without AMX

    def __call__(self, x: torch.Tensor, op: str = "none", other: torch.Tensor | None = None) -> torch.Tensor:
        kernel = route(x.shape[0], self)  # (T, in) -> (T, out)
        if kernel is Kernel.C_SMALL:
            return cpu_kernels.cpu_linear_small(x, self.small_weight, self.bias, op, other)
        if kernel is Kernel.C_AMX:
            return cpu_kernels.cpu_linear_amx(x, self.amx_weight, self.bias, op, other)
        if kernel is Kernel.ONEDNN:
            if op in ("mul", "add"):
                return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.onednn_weight, self.bias, op)
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, self.bias, _ONEDNN_UNARY[op], [], "")
        y = F.linear(x, self.weight, self.bias)  # the reference: the matmul, then the op on its rounded result
        if op == "silu":
            return F.silu(y)
        if op in ("mul", "add"):
            return y * other if op == "mul" else y + other
        return y

    def silu(self, x: torch.Tensor) -> torch.Tensor:  # silu(x W^T)
        return self(x, "silu")

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:  # (x W^T) * other
        return self(x, "mul", other)

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:  # (x W^T) + other
        return self(x, "add", other)


_ONEDNN_UNARY = {"none": "none", "silu": "swish"}


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except RuntimeError:  # e.g. no bf16 support on this CPU: the plain path still works
        return None


RmsNorm = Callable[[torch.Tensor, tuple[int, ...], torch.Tensor, float], torch.Tensor]


def rms_norm_for(shape: ModelShape, dtype: torch.dtype, device: torch.device) -> RmsNorm:
    """The C RMSNorm for bf16 on CPU (equal to HF's bit for bit), else ``F.rms_norm`` (in float32, the correctness
    reference, it is the one that equals HF's)."""
    limits = cpu_kernels.limits()
    if device.type == "cpu" and dtype == torch.bfloat16 and limits is not None and shape.hidden_size <= limits.max_row:
        return cpu_kernels.cpu_rms_norm
    return F.rms_norm


def build_decode_stack(layers: list, shape: ModelShape, dtype: torch.dtype,
                       attention: AttentionBackend) -> cpu_kernels.DecodeStack | None:
    """The C stack of ``layers`` (``model.Layer``), or None where a step cannot run every layer in C: not bf16, not
    the C attention (the stack runs its kernel), a shape the kernels do not take, or a projection without
    ``cpu_linear_small``'s copy."""
    if (dtype != torch.bfloat16 or not isinstance(attention, CpuAttention) or not layers
            or not cpu_kernels.DecodeStack.supports(shape.hidden_size, shape.num_heads, shape.num_kv_heads,
                                                    shape.head_dim)):
        return None
    projections = [[layer.qkv, layer.o, layer.gate, layer.up, layer.down] for layer in layers]
    if any(p.small_weight is None for ps in projections for p in ps):
        return None
    stack_layers = [
        cpu_kernels.StackLayer(
            layer.input_norm, layer.qkv.small_weight, layer.qkv.bias, layer.o.small_weight, layer.post_norm,
            layer.gate.small_weight, layer.up.small_weight, layer.down.small_weight,
            None if any(p.amx_weight is None for p in ps) else tuple(p.amx_weight for p in ps),
        )
        for layer, ps in zip(layers, projections)
    ]
    return cpu_kernels.DecodeStack(stack_layers, shape.hidden_size, shape.intermediate_size, shape.num_heads,
                                   shape.num_kv_heads, shape.head_dim, shape.rms_norm_eps)


def run_decode_stack(
    stack: cpu_kernels.DecodeStack,
    h: torch.Tensor,  # [T, D] residual stream, updated in place
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_len, head_dim]
    sin_signed: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> bool:
    """Every layer over ``h`` in one C call where the step is decodes only and :func:`route` sends every projection
    of it to C; False (nothing done) elsewhere."""
    num_rows = h.shape[0]
    return (meta.is_decode_only and meta.num_decode_tokens == num_rows and num_rows <= c_rows_limit(stack.takes_amx)
            and stack(h, positions, cos, sin_signed, kv_caches, meta.slot_mapping, meta.block_tables,
                      meta.context_lens, meta.scale, small_rows_limit(stack.takes_amx)))
