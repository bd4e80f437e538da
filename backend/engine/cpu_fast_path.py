"""The model's fast path on a CPU beyond its projections (``linear``: the layout each weight is held in and the
kernel each projection runs): the RMSNorm kernel, and the decode stack (every layer of a small decode step in one C
call), which takes a step exactly where ``linear.route`` sends every projection of it to C. On CUDA, in float32, or
without the C kernels, the plain ``F.rms_norm`` and the layer-by-layer loop run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from backend.engine import linear
from backend.engine.attention import AttentionBackend, AttentionMetadata, CpuAttention
from backend.engine.config import ModelShape
from backend.kernels import cpu_kernels

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
    the C attention (the stack runs its kernel), a shape the kernels do not take, or projections not all in the
    C kernels' bf16 layout or all in one quantized layout the stack reads (Q4_1, INT8)."""
    if (dtype != torch.bfloat16 or not isinstance(attention, CpuAttention) or not layers
            or not cpu_kernels.DecodeStack.supports(shape.hidden_size, shape.num_heads, shape.num_kv_heads,
                                                    shape.head_dim)):
        return None
    layouts = {p.layout for layer in layers for p in (layer.qkv, layer.o, layer.gate, layer.up, layer.down)}
    readable = {linear.held_layout(f): f for f in cpu_kernels.DecodeStack.WEIGHT_FORMATS}  # layout -> its format
    weight_format = readable.get(layouts.pop())
    if layouts or weight_format is None:
        return None
    stack_layers = [
        cpu_kernels.StackLayer(layer.input_norm, layer.qkv.weight, layer.qkv.bias, layer.o.weight, layer.post_norm,
                               layer.gate.weight, layer.up.weight, layer.down.weight)
        for layer in layers
    ]
    return cpu_kernels.DecodeStack(stack_layers, shape.hidden_size, shape.intermediate_size, shape.num_heads,
                                   shape.num_kv_heads, shape.head_dim, shape.rms_norm_eps, weight_format)


def run_decode_stack(
    stack: cpu_kernels.DecodeStack,
    h: torch.Tensor,  # [T, D] residual stream, updated in place
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_len, head_dim]
    sin_signed: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> bool:
    """Every layer over ``h`` in one C call where the step is decodes only and ``linear.route`` sends every projection
    of it to C (up to the stack's own row limit); False (nothing done) elsewhere."""
    num_rows = h.shape[0]
    layout = linear.held_layout(stack.weight_format)
    return (meta.is_decode_only and meta.num_decode_tokens == num_rows and num_rows <= linear.c_rows_limit(layout)
            and stack(h, positions, cos, sin_signed, kv_caches, meta.slot_mapping, meta.block_tables,
                      meta.context_lens, meta.scale, linear.small_rows_limit(layout)))
