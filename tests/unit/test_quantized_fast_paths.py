"""The quantized kernels' paths (``quantized_linear.kernel_path``) each give their torch twin's result at the model's
shapes and odd ones: the twin computes what the build's kernel computes for that many rows (weights widened to
float32, x quantized to int8, or weights widened to bf16 on AMX tiles), so they differ only in the order of a
float32 sum. The bound is that sum's worst case plus one bf16 rounding step of the output; it depends on the inputs,
not on a CPU. The last test runs this file again on kernels built for x86-64-v2, where every path is the float32 one.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backend.kernels import cpu_kernels
from backend.kernels.quantized_linear import KERNEL_PATHS, cpu_quantized_linear, kernel_path, quantize
from backend.kernels.weight_format import WeightFormat
from tests.unit.test_quantized_linear import assert_within_fp32_order  # the bound's one owner

Q4_1, Q8_0, INT8 = WeightFormat.Q4_1, WeightFormat.Q8_0, WeightFormat.INT8

needs_c = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the torch path is used")


def case(fmt, n, k, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = quantize(fmt, torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(rows, k + 8, generator=gen).to(torch.bfloat16)[:, :k]  # strided rows
    bias = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16)
    other = torch.randn(rows, n + 4, generator=gen).to(torch.bfloat16)[:, :n]
    return weight, x, bias, other


@needs_c
@pytest.mark.parametrize("fmt", [Q4_1, Q8_0, INT8])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 31, 32, 33, 64, 65])
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (48, 576), (32, 64), (40, 96), (8, 32)],
                         ids=["qkv", "down", "half-panel", "tiny", "rows-past-a-group", "under-a-group"])
def test_every_path_equals_its_twin(fmt, rows, n, k):
    weight, x, bias, other = case(fmt, n, k, rows, seed=rows * 7 + n)
    for op, b, o in (("none", bias, None), ("silu", None, None), ("mul", None, other), ("add", None, other)):
        got = cpu_quantized_linear(fmt, x, weight, b, op, o)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        assert_within_fp32_order(fmt, got, x.contiguous(), weight, b, op, o)


@needs_c
def test_the_lm_heads_shape_on_every_thread():
    """The tied LM head's Q8_0 weight (49,152 x 576 in the model; a slice of its rows here) at a decode step's rows."""
    for rows in (1, 8, 9, 33, 64):
        weight, x, _, _ = case(Q8_0, 4096, 576, rows, seed=rows)
        assert_within_fp32_order(Q8_0, cpu_quantized_linear(Q8_0, x, weight), x, weight, None, "none", None)


@needs_c
def test_paths_are_what_the_build_has():
    """A path is taken only where the build has it: x_int8 for q4_1, and for q8_0 only where AMX does not run (the
    Intel paths stay as they were measured), bf16 tiles where AMX runs, and every path the same for a given row count
    whatever the weight's values."""
    for fmt in (Q4_1, Q8_0, INT8):
        for rows in (1, 3, 8, 17, 64):
            path = kernel_path(fmt, rows, 576, 960)
            assert path in KERNEL_PATHS
            assert path != "x_int8" or fmt == Q4_1 or (fmt == Q8_0 and not cpu_kernels.has_amx())
            assert path != "bf16_tiles" or cpu_kernels.has_amx()
    if cpu_kernels.has_amx():
        assert kernel_path(Q8_0, 1, 576, 960) == "float32"
    if cpu_kernels.has_amx():
        assert kernel_path(Q4_1, 64, 576, 960) == "bf16_tiles"
        assert kernel_path(Q4_1, 64, 576, 40) != "bf16_tiles"  # whole tiles of 16 outputs only


def test_without_the_kernels_the_twin_widens_to_float32(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    assert kernel_path(Q4_1, 64, 576, 960) == "float32"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the baseline ISA below is x86-64's")
def test_every_path_holds_without_avx512_or_amx(tmp_path):
    """Built for x86-64-v2 (no AVX at all), the kernels take the float32 path at every row count and still equal
    their twins, in a process of their own."""
    env = {**os.environ, "LLM_CPU_MARCH": "x86-64-v2", "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "not without_avx512"], env=env, cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert list(tmp_path.rglob("cpu_kernels-*.so")), "the kernels were not rebuilt for the baseline ISA"
