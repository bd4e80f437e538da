"""The model's projection, :class:`Linear`, on every device: the one layout its weight is held in, and which kernel
runs it for how many rows.

Each weight is laid out once, at load, for the kernels this device and build run (:class:`Layout`), and held in that
one copy; one routing function, :func:`route`, sends each projection to a kernel by its row count. On CUDA, in
float32, or without the C kernels, every projection is the plain ``F.linear`` and its elementwise op (the reference
path) or oneDNN. The reasons behind the row limits are in ``docs/cpu-kernels.md``.

With ``quantization`` (q4_1, int8) each projection is held quantized instead (``backend/kernels/quantized_linear.py``):
a decode step's rows run the quantized C kernel, a prefill's many rows widen the weight to bf16 and run the bf16
route above, and without the C kernels the torch twin (the dequantized weight into ``F.linear``) runs.
"""

from __future__ import annotations

import enum
import functools
import sys

import torch
import torch.nn.functional as F

from backend.kernels import cpu_kernels, quantized_linear
from backend.kernels.weight_format import WeightFormat

# Up to this many rows a bf16 projection streams its row-major weight through linear_small once, faster than
# oneDNN's matmul (builds without AVX512-BF16; above it the reference F.linear runs). Builds with AVX2 and FMA take
# every row count in linear_small (its panels from 9 rows): torch's bf16 matmul is 10x slower than its float32 one
# on a CPU without AVX512-BF16.
SMALL_BATCH_ROWS = 8
# Where the CPU has AMX, linear_small reading the packed weight is faster than linear_amx up to this many rows, and
# linear_amx above, at every row count (as fast as oneDNN's AMX matmuls at 128 and 512 rows). Without AMX,
# linear_small takes every row count: faster than oneDNN's AVX512-BF16 matmuls to 64 rows, within 10 % at 512.
SMALL_BATCH_ROWS_WITH_AMX = 6
# Up to this many rows a quantized projection runs its C kernel (which widens the weight in registers, or from a few
# rows a panel at a time into AMX tiles: quantized_linear.kernel_path); above it the weight is widened to bf16 once
# per call and the bf16 matmuls run. 64 is the decode stack's row limit (cpu_kernels.Limits.linear_max_rows).
QUANTIZED_ROWS = 64


class Layout(enum.Enum):
    """How a :class:`Linear` holds its one copy of the weight, chosen at load for this device and build."""

    PACKED = "packed"  # bf16, AMX tiles' layout (cpu_kernels.prepare_linear_weight): linear_small and linear_amx
    ROW_MAJOR = "row_major"  # bf16, builds without AVX512-BF16: linear_small (every row count with AVX2), else F.linear
    ONEDNN = "onednn"  # oneDNN's blocked layout (float32, or a shape the packed layout does not fit)
    PLAIN = "plain"  # as loaded: F.linear (CUDA, or no oneDNN)
    # quantized (uint8 [N, row bytes], as quantized_linear holds the format): the quantized C kernels, or widened
    Q4_1 = WeightFormat.Q4_1
    Q8_0 = WeightFormat.Q8_0
    INT8 = WeightFormat.INT8

    @property
    def weight_format(self) -> WeightFormat | None:
        """The format a quantized layout holds; None for the others (the weight's dtype says what they hold)."""
        return self.value if isinstance(self.value, WeightFormat) else None

    @property
    def quantized(self) -> bool:
        return self.weight_format is not None


class Kernel(enum.Enum):
    C_SMALL = "cpu_linear_small"
    C_AMX = "cpu_linear_amx"
    ONEDNN = "onednn"  # torch's mkldnn linear with the weight in oneDNN's blocked layout
    TORCH = "torch"  # F.linear, then the elementwise op: the reference
    C_QUANTIZED = "cpu_quantized_linear"  # the quantized weight as it is held
    DEQUANTIZED = "dequantized"  # the quantized weight widened to bf16 for this call, then the bf16 route


def small_rows_limit(layout: Layout) -> int:
    """The most rows ``cpu_linear_small`` (or a quantized layout's kernel) runs from a weight of ``layout``."""
    if layout.quantized:
        return QUANTIZED_ROWS
    if layout is Layout.PACKED:
        return SMALL_BATCH_ROWS_WITH_AMX if _has_amx() else sys.maxsize
    return sys.maxsize if _row_major_any_rows() else SMALL_BATCH_ROWS


def c_rows_limit(layout: Layout) -> int:
    """The most rows a projection of ``layout`` (packed or row-major) runs in C: ``cpu_linear_amx`` takes any number
    above the small kernel's (packed weights, where the CPU has AMX)."""
    return sys.maxsize if layout is Layout.PACKED else small_rows_limit(layout)


@functools.cache
def _has_amx() -> bool:
    return cpu_kernels.has_amx()


@functools.cache
def _row_major_any_rows() -> bool:
    return cpu_kernels.row_major_any_rows()


@functools.cache
def c_layout() -> Layout:
    """The layout ``cpu_kernels.prepare_linear_weight`` gives in this build."""
    return Layout.PACKED if cpu_kernels.weight_packed() else Layout.ROW_MAJOR


def held_layout(fmt: WeightFormat) -> Layout:
    """The layout a weight of ``fmt`` is held in by the C kernels of this build: bf16's :func:`c_layout`, a quantized
    format's its own."""
    return c_layout() if fmt is WeightFormat.BF16 else Layout(fmt)


def route(num_rows: int, linear: Linear) -> Kernel:
    """The kernel that runs ``linear`` over ``num_rows`` rows: the one place this is decided."""
    layout = linear.layout
    if layout.quantized:
        if cpu_kernels.load() is None:
            return Kernel.TORCH
        return Kernel.C_QUANTIZED if num_rows <= small_rows_limit(layout) else Kernel.DEQUANTIZED
    if layout is Layout.PACKED or layout is Layout.ROW_MAJOR:
        if num_rows <= small_rows_limit(layout):
            return Kernel.C_SMALL
        if num_rows <= c_rows_limit(layout):
            return Kernel.C_AMX
    return Kernel.ONEDNN if layout is Layout.ONEDNN else Kernel.TORCH


def lay_out(weight: torch.Tensor) -> tuple[torch.Tensor, Layout]:
    """``weight`` (out, in) in the one layout this CPU's kernels read, chosen once at load."""
    prepared = cpu_kernels.prepare_linear_weight(weight)  # None off CPU bf16, without the C kernels, or a misfit
    if prepared is not None:
        return prepared, c_layout()
    packed = _onednn_pack(weight)  # a plain F.linear on CPU re-lays the weight out on every call
    return (weight, Layout.PLAIN) if packed is None else (packed, Layout.ONEDNN)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                quantization: WeightFormat | None = None) -> Linear:
    """A :class:`Linear` of ``weight`` (out, in): as :func:`lay_out` lays it out, or quantized to ``quantization``
    where that format holds its rows; else in ``weight``'s dtype."""
    if quantization is None or weight.device.type != "cpu" or not quantized_linear.fits(quantization,
                                                                                         weight.shape[1]):
        return Linear(weight, bias)
    return Linear(quantized_linear.quantize(quantization, weight), bias, Layout(quantization))


class Linear:
    """``op(x @ weight.T + bias)``, op one of none, silu, ``* other`` or ``+ other`` (the elementwise work that
    follows a matmul in a decoder layer, fused where the kernel allows: on the float32 sum, one rounding).

    The weight is held once, in the layout :func:`lay_out` chose for it (or given laid out, from a file of prepared
    weights); :func:`route` picks the kernel per call among those that read that layout.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, layout: Layout | None = None) -> None:
        self.bias = bias  # weight: (out, in), laid out already where a layout is given
        self.weight, self.layout = lay_out(weight) if layout is None else (weight, layout)

    def __call__(self, x: torch.Tensor, op: str = "none", other: torch.Tensor | None = None) -> torch.Tensor:
        kernel = route(x.shape[0], self)  # (T, in) -> (T, out)
        if kernel is Kernel.C_SMALL:
            return cpu_kernels.cpu_linear_small(x, self.weight, self.bias, op, other)
        if kernel is Kernel.C_AMX:
            return cpu_kernels.cpu_linear_amx(x, self.weight, self.bias, op, other)
        if kernel is Kernel.C_QUANTIZED:
            return quantized_linear.cpu_quantized_linear(self.layout.weight_format, x, self.weight, self.bias, op,
                                                         other)
        if kernel is Kernel.DEQUANTIZED:  # a prefill's rows: the bf16 matmuls' cost dwarfs widening the weight
            widened = quantized_linear.cpu_dequantize(self.layout.weight_format, self.weight)
            return Linear(widened, self.bias)(x, op, other)
        if kernel is Kernel.ONEDNN:
            if op in ("mul", "add"):
                return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, op)
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, _ONEDNN_UNARY[op], [], "")
        # the reference: the matmul, then the op on its rounded result
        y = F.linear(x, self.dense_weight(), self.bias)
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

    def dense_weight(self) -> torch.Tensor:
        """The weight row-major (out, in): a copy where it is packed (the reference path's, never the engine's), in
        bf16 where it is quantized."""
        if self.layout.quantized:
            return quantized_linear.dequantize(self.layout.weight_format, self.weight).to(torch.bfloat16)
        if self.layout is Layout.PACKED:
            return cpu_kernels.linear_weight_dense(self.weight)
        if self.layout is Layout.ONEDNN:
            raise ValueError("oneDNN's blocked layout is not read back")
        return self.weight

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor | None:  # (len(rows), in)
        """Rows of the weight (a tied embedding's lookup into the LM head), or None where the layout hides them."""
        if self.layout is Layout.ONEDNN:
            return None
        if self.layout is Layout.PLAIN:
            return self.weight.index_select(0, rows)
        if self.layout.quantized:
            held = quantized_linear.gguf_rows(self.layout.weight_format, self.weight, rows)
            return quantized_linear.dequantize(self.layout.weight_format, held).to(torch.bfloat16)
        return cpu_kernels.linear_weight_rows(self.weight, rows)


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
