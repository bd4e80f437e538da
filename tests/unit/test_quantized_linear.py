"""The quantized projections' C kernels give their torch twins' results; the formats hold what they claim.

The kernels and the twins widen every weight to the same float32 value, so they differ only in the order of a
float32 sum over K products: the bound below is that sum's worst-case error (K ulps of the sum of magnitudes), plus
one bf16 rounding step of the output, which such a difference can tip. It depends on the inputs, not on a CPU.
"""

from __future__ import annotations

import pytest
import torch

from backend.kernels import cpu_kernels
from backend.kernels.quantized_linear import (
    cpu_dequantize,
    cpu_quantized_linear,
    dequantize,
    in_features,
    kernel_path,
    quantize,
    quantized_linear_reference,
    row_bytes,
    x_int8_terms,
)
from backend.kernels.weight_format import WeightFormat

Q4_1, Q8_0, INT8 = WeightFormat.Q4_1, WeightFormat.Q8_0, WeightFormat.INT8

needs_c = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the torch path is used")
FORMATS = (Q4_1, INT8, Q8_0)


def case(fmt, n, k, rows, seed=0, with_bias=False):
    gen = torch.Generator().manual_seed(seed)
    weight = quantize(fmt, torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16) if with_bias else None
    other = torch.randn(rows, n, generator=gen).to(torch.bfloat16)
    return weight, x, bias, other


def assert_within_fp32_order(fmt, got, x, weight, bias, op, other):
    want = quantized_linear_reference(fmt, x, weight, bias, op, other).float()
    if kernel_path(fmt, *x.shape, weight.shape[0]) == "x_int8":  # the per-block terms the kernel adds, each rounded
        magnitude = sum(term.abs().sum(dim=2) for term in x_int8_terms(fmt, x, weight) if term is not None)
    else:
        magnitude = x.float().abs() @ dequantize(fmt, weight).abs().T  # (T, N): sum |x w|
    if op == "mul":
        magnitude = magnitude * other.float().abs()
    k = x.shape[1]
    bound = 2 * k * 2.0**-24 * magnitude + 2.0**-7 * want.abs() + 1e-30
    err = (got.float() - want).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"


@needs_c
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 13, 64])
@pytest.mark.parametrize("op", ["none", "silu", "mul", "add"])
def test_kernel_equals_reference(fmt, rows, op):
    weight, x, bias, other = case(fmt, 80, 576, rows, seed=rows, with_bias=op == "none")
    other = other if op in ("mul", "add") else None
    got = cpu_quantized_linear(fmt, x, weight, bias, op, other)
    assert got.shape == (rows, 80) and got.dtype == torch.bfloat16
    assert_within_fp32_order(fmt, got, x, weight, bias, op, other)


@needs_c
@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_reads_strided_rows_and_a_big_weight_on_every_thread(fmt):
    weight, x, _, other = case(fmt, 1536, 1536, 6, seed=3)
    wide = torch.zeros(6, 2000, dtype=torch.bfloat16)
    wide[:, :1536] = x
    got = cpu_quantized_linear(fmt, wide[:, :1536], weight, None, "add", other)
    assert_within_fp32_order(fmt, got, x, weight, None, "add", other)


@needs_c
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_kernel_equals_reference_to_the_bit(fmt):
    weight = case(fmt, 48, 160, 1, seed=7)[0]
    assert torch.equal(cpu_dequantize(fmt, weight), dequantize(fmt, weight).to(torch.bfloat16))


@needs_c
def test_kernels_refuse_what_they_cannot_take():
    weight, x, _, _ = case(Q4_1, 32, 64, 2)
    with pytest.raises(ValueError):
        cpu_quantized_linear(Q4_1, x.float(), weight)  # float32 activations
    with pytest.raises(ValueError):
        cpu_quantized_linear(Q4_1, x[:, :32], weight)  # K does not match the weight's


@pytest.mark.parametrize("fmt", FORMATS)
def test_formats_round_trip_within_their_step(fmt):
    """Quantizing then dequantizing moves each weight by at most half a step of its block (or row)."""
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(1))
    q = quantize(fmt, w)
    assert q.dtype == torch.uint8 and q.shape == (16, row_bytes(fmt, 96)) and in_features(fmt, q.shape[1]) == 96
    back = dequantize(fmt, q)
    if fmt == INT8:
        step = w.abs().amax(dim=1, keepdim=True) / 127
    else:
        blocks = w.view(16, 3, 32)
        span = blocks.amax(2, keepdim=True) - blocks.amin(2, keepdim=True) if fmt == Q4_1 else blocks.abs().amax(
            2, keepdim=True) * 2
        step = (span / (15 if fmt == Q4_1 else 254)).expand(16, 3, 32).reshape(16, 96)
    # half a step, plus the fp16 rounding of the block's scale (times at most 15 or 127 steps: within the block's
    # span) and of its min: 2^-11 relative each, at most 3 times the largest magnitude
    assert bool(((back - w).abs() <= 0.5 * step + 3 * 2.0**-11 * w.abs().max() + 1e-7).all())


def test_q4_1_layout_is_ggufs():
    """One hand-built block: d = 0.5, m = -1, weight j < 16 from the low nibble of byte j, 16 + j from its high."""
    nibbles = torch.tensor([(j % 16) | ((15 - j % 16) << 4) for j in range(16)], dtype=torch.uint8)
    head = torch.tensor([0.5, -1.0], dtype=torch.float16).view(torch.uint8)
    block = torch.cat([head, nibbles]).view(1, 20)
    want = torch.tensor([0.5 * j - 1 for j in range(16)] + [0.5 * (15 - j) - 1 for j in range(16)])
    assert torch.equal(dequantize(Q4_1, block), want.view(1, 32))
