"""q4_1 as held: GGUF's blocks with the rows in groups of 16 (``quantized_linear.group_rows``), the rows past the
last whole group as GGUF's. The grouping only reorders GGUF's bytes, and every kernel path reads it, tail rows
included, as its torch twin does."""

from __future__ import annotations

import pytest
import torch

from backend.engine.linear import Layout, Linear
from backend.kernels import cpu_kernels
from backend.kernels.quantized_linear import (
    cpu_dequantize,
    cpu_quantized_linear,
    dequantize,
    group_rows,
    kernel_path,
    quantize,
    ungroup_rows,
)
from backend.kernels.weight_format import WeightFormat
from tests.unit.test_quantized_linear import assert_within_fp32_order  # the bound's one owner

Q4_1, Q8_0 = WeightFormat.Q4_1, WeightFormat.Q8_0

needs_c = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the torch path is used")


def gguf_rows(n, k, seed=0):
    """Random GGUF Q4_1 rows (any bytes are valid blocks, but keep d and m finite and small)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 20), generator=gen, dtype=torch.uint8)
    dm = (torch.rand(n, k // 32, 2, generator=gen) * 0.02 - 0.01).to(torch.float16).view(torch.uint8)
    blocks[:, :, :4] = dm
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("n", [1, 15, 16, 40, 96])
def test_grouping_reorders_ggufs_bytes_and_back(n):
    rows = gguf_rows(n, 96, seed=n)
    held = group_rows(Q4_1, rows)
    assert held.shape == rows.shape and held.dtype == torch.uint8
    assert torch.equal(torch.sort(held.flatten()).values, torch.sort(rows.flatten()).values)
    assert torch.equal(ungroup_rows(Q4_1, held), rows)
    assert torch.equal(held[n // 16 * 16:], rows[n // 16 * 16:])  # the tail as GGUF's


def test_a_groups_block_is_its_rows_scales_then_their_nibbles_four_bytes_at_a_time():
    rows = gguf_rows(32, 64, seed=1)
    held = group_rows(Q4_1, rows)
    unit = held.flatten()[320 * 3: 320 * 4]  # group 1, block 1 (K / 32 = 2 blocks a group)
    block = rows[16:32].reshape(16, 2, 20)[:, 1]  # (16 rows, 20 bytes)
    assert torch.equal(unit[:64].view(16, 4), block[:, :4])
    assert torch.equal(unit[64:].view(4, 16, 4), block[:, 4:].reshape(16, 4, 4).transpose(0, 1))


def test_other_formats_are_held_as_ggufs():
    rows = torch.randint(0, 256, (32, 68), dtype=torch.uint8)
    assert group_rows(Q8_0, rows) is rows and ungroup_rows(Q8_0, rows) is rows


def test_quantize_holds_rows_grouped_and_dequantize_reads_them():
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)) * 0.05
    held = quantize(Q4_1, w)
    rows = ungroup_rows(Q4_1, held)
    one_by_one = torch.cat([dequantize(Q4_1, rows[i:i + 1]) for i in range(40)])  # a lone row is GGUF's as held
    assert torch.equal(dequantize(Q4_1, held), one_by_one)
    assert torch.equal(quantize(Q4_1, w[:1]), rows[:1])


@needs_c
@pytest.mark.parametrize("n", [8, 24, 40, 160])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17])
def test_every_path_reads_groups_and_tail_rows(n, rows):
    gen = torch.Generator().manual_seed(rows * 31 + n)
    weight = quantize(Q4_1, torch.randn(n, 576, generator=gen) * 0.05)
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    bias = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16)
    other = torch.randn(rows, n, generator=gen).to(torch.bfloat16)
    for op, b, o in (("none", bias, None), ("silu", None, None), ("mul", None, other), ("add", None, other)):
        got = cpu_quantized_linear(Q4_1, x, weight, b, op, o)
        assert_within_fp32_order(Q4_1, got, x, weight, b, op, o)
    if n % 16:
        assert kernel_path(Q4_1, rows, 576, n) != "bf16_tiles"  # whole tiles of 16 outputs only


@needs_c
@pytest.mark.parametrize("n", [8, 40, 64])
def test_dequantize_kernel_reads_groups_and_tail_rows_to_the_bit(n):
    weight = quantize(Q4_1, torch.randn(n, 160, generator=torch.Generator().manual_seed(n)) * 0.05)
    assert torch.equal(cpu_dequantize(Q4_1, weight), dequantize(Q4_1, weight).to(torch.bfloat16))


def test_rows_of_a_held_q4_1_weight_read_back():
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(3)) * 0.05
    linear = Linear(quantize(Q4_1, w), None, Layout.Q4_1)
    ids = torch.tensor([0, 17, 39])
    assert torch.equal(linear.weight_rows(ids), linear.dense_weight()[ids])


def test_files_of_prepared_weights_are_keyed_by_the_held_layout(monkeypatch, tmp_path):
    """A file prepared before the held bytes changed is never read with their new meaning."""
    from backend.engine import weight_file
    from backend.kernels import quantized_linear

    (tmp_path / "config.json").write_text("{}")
    before = weight_file.weights_path(tmp_path, torch.bfloat16, Q4_1)
    monkeypatch.setattr(quantized_linear, "HELD_LAYOUT_VERSION", quantized_linear.HELD_LAYOUT_VERSION + 1)
    assert weight_file.weights_path(tmp_path, torch.bfloat16, Q4_1) != before
