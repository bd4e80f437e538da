"""The C kernels for CPUs give their torch twins' results on the same inputs.

Pools hold random values everywhere (unused blocks included) and blocks are handed out shuffled, so reading a
position outside a sequence's context shows up as an error. A kernel refuses (``ValueError``) what it cannot take
instead of running its twin, so a test that gets a result from it knows the C code ran.
"""

from __future__ import annotations

import os
import platform
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backend.engine.attention import CpuAttention, TorchAttention
from backend.engine.attention.torch_backend import (
    attend_prefills,
    decode_gather_indices,
    paged_decode_attention,
    rope_qkv,
    write_kv,
)
from backend.kernels import cpu_kernels
from tests.attention_cases import rope_step_case

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the torch path is used")

TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=1e-5), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def scattered_case(num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = (2 * torch.randn(shape, generator=gen)).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in context_lens]
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    # A strided query, as the model passes it: a view into the fused q/k projection output.
    fused = torch.randn(len(context_lens), num_heads + num_kv_heads, head_dim, generator=gen).to(dtype)
    query = fused[:, :num_heads]
    return query, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(9, 3, 64, 16), (4, 4, 64, 16), (8, 1, 128, 32), (4, 2, 32, 8)],
    ids=["smollm2-gqa3", "mha", "gqa8-hd128", "gqa2-bs8"],
)
def test_kernel_matches_torch_reference(num_heads, num_kv_heads, head_dim, block_size, dtype):
    context_lens = [1, block_size, block_size + 1, 77, 3 * block_size - 1, 130]
    query, k_cache, v_cache, tables, lens = scattered_case(
        num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype
    )
    scale = head_dim**-0.5
    assert cpu_kernels.supports(query, k_cache, v_cache)  # the C kernel runs (it refuses what it does not take)
    out = cpu_kernels.cpu_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    ref = paged_decode_attention(query.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    assert out.shape == (len(context_lens), num_heads, head_dim) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(9, 3, 64, 16), (4, 4, 64, 16), (8, 1, 128, 32), (12, 2, 64, 16)],
    ids=["smollm2-gqa3", "mha", "gqa8-hd128", "gqa6-two-passes"],
)
def test_bf16_decode_attention_reads_the_pool_in_place_or_widened_alike(num_heads, num_kv_heads, head_dim,
                                                                          block_size):
    """bf16 items read K and V rows straight from the pool (as shipped), or widen each tile to float32 first (the
    bench's baseline): both give the torch reference's result, at every context length around a tile's edges, with
    query heads per KV head from 1 to more than one pass of accumulators holds; the default path is the direct one."""
    context_lens = [1, 15, 16, 17, 31, 33, 77, 130, 200]
    query, k_cache, v_cache, tables, lens = scattered_case(
        num_heads, num_kv_heads, head_dim, block_size, context_lens, torch.bfloat16
    )
    scale = head_dim**-0.5
    ref = paged_decode_attention(query.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    default = cpu_kernels.cpu_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    outputs = {}
    try:
        for widened in (True, False):
            cpu_kernels.set_decode_attention_widened(widened)
            outputs[widened] = cpu_kernels.cpu_decode_attention(query, k_cache, v_cache, tables, lens, scale)
    finally:
        cpu_kernels.set_decode_attention_widened(False)
    for out in outputs.values():
        torch.testing.assert_close(out.float(), ref, **TOLERANCE[torch.bfloat16])
    assert torch.equal(default, outputs[False])
    # The two differ only in the order of float32 sums: at most one bf16 step apart, in a few elements.
    apart = (outputs[True].float() - outputs[False].float()).abs()
    assert apart.max() <= 2 ** -7 * outputs[False].float().abs().max() and (apart > 0).float().mean() < 0.05


def test_kernel_equals_reference_with_precomputed_metadata_and_threads():
    query, k_cache, v_cache, tables, lens = scattered_case(9, 3, 64, 16, [5, 40, 200, 17] * 8, torch.float32)
    slots, mask = decode_gather_indices(tables, lens, 16)
    ref = paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, slots, mask)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            out = cpu_kernels.cpu_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
            torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32])
    finally:
        torch.set_num_threads(threads)


def test_unsupported_inputs_are_refused_and_the_backend_runs_torch_for_them():
    """float16 is not a dtype the kernels take: the kernel refuses it, and the CPU backend runs the torch reference."""
    query, k_cache, v_cache, tables, lens = scattered_case(4, 2, 64, 16, [9, 33], torch.float16)
    assert not cpu_kernels.supports(query, k_cache, v_cache)
    with pytest.raises(ValueError, match="cannot take"):
        cpu_kernels.cpu_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    qkv, positions, cos, sin, k_cache, v_cache, common = rope_step_case([9, 33], [(0, 5)], torch.float16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = TorchAttention().forward(qkv.clone(), positions, cos, sin, k_ref, v_ref, common, 9)
    out = CpuAttention().forward(qkv, positions, cos, sin, k_cache, v_cache, common, 9)
    assert torch.equal(out, ref) and torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


ROPE_CASES = dict(
    argnames="decode_lens, chunks",
    argvalues=[([70], []), ([5, 16, 17, 40, 1, 130, 33, 64, 9, 2], []), ([5, 16, 40], [(0, 20), (33, 40)]),
               ([], [(0, 7)])],
    ids=["one-decode", "ten-decodes", "decodes-and-chunks", "one-chunk"],
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(**ROPE_CASES)
def test_rope_attention_kernel_matches_torch_reference(decode_lens, chunks, dtype):
    """Rotary embedding, K/V write and decode attention in one C call equal the torch ops they replace: the decodes'
    output, the rotated q and k left in the QKV buffer, and every token's K/V in the pool. The reference runs on
    copies (``.float()`` of a float32 tensor is that tensor), so a kernel that skips a write fails."""
    qkv, positions, cos, sin, k_cache, v_cache, meta = rope_step_case(decode_lens, chunks, dtype)
    num_tokens, num_decodes = qkv.shape[0], meta.num_decode_tokens
    query, key, value = rope_qkv(qkv.float().clone(), positions, cos.float(), sin.float(), 9, 3)
    k_ref, v_ref = k_cache.float().clone(), v_cache.float().clone()
    write_kv(k_ref, v_ref, key, value, meta.slot_mapping)
    assert cpu_kernels.supports_rope_attention(qkv, positions, cos, sin, meta.slot_mapping, k_cache, v_cache, 9)
    out = cpu_kernels.cpu_rope_paged_attention(qkv, positions, cos, sin, meta.slot_mapping, k_cache, v_cache,
                                               meta.block_tables, meta.context_lens, num_decodes, meta.scale, 9)
    assert out.shape == (num_tokens, 9, 64) and out.dtype == dtype
    if num_decodes:
        ref = paged_decode_attention(query[:num_decodes], k_ref, v_ref, meta.block_tables, meta.context_lens,
                                     meta.scale)
        torch.testing.assert_close(out[:num_decodes].float(), ref, **TOLERANCE[dtype])
    rotated = qkv[:, : 12 * 64].view(num_tokens, 12, 64).float()  # q's 9 heads, then k's 3, rotated in place
    torch.testing.assert_close(rotated, torch.cat([query, key], dim=1), **TOLERANCE[dtype])
    torch.testing.assert_close(k_cache.float(), k_ref, **TOLERANCE[dtype])
    assert torch.equal(v_cache.float(), v_ref)  # values are copied, not rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(**ROPE_CASES)
def test_cpu_backend_step_matches_torch_backend(decode_lens, chunks, dtype):
    """A whole step through the C attention backend (the kernel, then the prefill chunks in torch) gives the torch
    reference backend's output and pool."""
    qkv, positions, cos, sin, k_cache, v_cache, common = rope_step_case(decode_lens, chunks, dtype)
    k_ref, v_ref = k_cache.float().clone(), v_cache.float().clone()
    reference, backend = TorchAttention(), CpuAttention()
    ref = reference.forward(qkv.float().clone(), positions, cos.float(), sin.float(), k_ref, v_ref,
                            reference.build_metadata(common), 9)
    out = backend.forward(qkv, positions, cos, sin, k_cache, v_cache, backend.build_metadata(common), 9)
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])
    torch.testing.assert_close(k_cache.float(), k_ref, **TOLERANCE[dtype])
    assert torch.equal(v_cache.float(), v_ref)


PREFILL_CASES = dict(
    argnames="decode_lens, chunks",
    argvalues=[([], [(0, 1)]), ([], [(0, 128)] * 4), ([], [(0, 250)]), ([2, 71], [(0, 37), (0, 37), (100, 60)]),
               ([], [(150, 100), (0, 16), (3, 1)])],
    ids=["one-token", "four-prompts", "a-long-prompt", "decodes-prompts-and-a-cached-prefix", "cached-prefixes"],
)


@pytest.mark.skipif(not cpu_kernels.prefill_attention_available(),
                    reason="the prefill kernel needs AVX512-BF16, or AVX2 and FMA")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(**PREFILL_CASES)
def test_prefill_kernel_matches_torch_reference(decode_lens, chunks, head_dim):
    """Every chunk attends, in one C call, to its cached prefix and itself, causally (keys read from the pool
    through its slots), as the torch reference does in float32: the chunks' rows only, the decodes' left alone."""
    qkv, positions, cos, sin, k_cache, v_cache, common = rope_step_case(decode_lens, chunks, torch.bfloat16,
                                                                        head_dim=head_dim)
    out = cpu_kernels.cpu_rope_paged_attention(qkv, positions, cos, sin, common.slot_mapping, k_cache, v_cache,
                                               common.block_tables, common.context_lens, len(decode_lens),
                                               common.scale, 9)  # rotates q and k in qkv, fills the pool
    before = out[: len(decode_lens)].clone()
    plan = cpu_kernels.prefill_plan(common.prefills, common.slot_mapping)
    cpu_kernels.cpu_prefill_attention(out, qkv, k_cache, v_cache, plan, common.scale, 9)
    num_tokens = qkv.shape[0]
    query, key, value = qkv.float().view(num_tokens, 15, head_dim).split([9, 3, 3], dim=1)  # q and k rotated
    ref = torch.full_like(query, float("nan"))
    attend_prefills(ref, query, key, value, k_cache.float(), v_cache.float(),
                    [replace(c, context_slots=plan[1][o: o + c.num_cached_tokens + c.num_query_tokens])
                     for c, o in zip(common.prefills, plan[0][:, 3].tolist())], common.scale)
    rows = slice(len(decode_lens), num_tokens)
    torch.testing.assert_close(out[rows].float(), ref[rows], **TOLERANCE[torch.bfloat16])
    assert torch.equal(out[: len(decode_lens)], before)


def test_prefill_kernel_refuses_what_it_does_not_take_and_the_backend_runs_torch():
    """float32 (or a build without the kernel) is refused by name; the CPU backend then attends the chunks with
    torch's SDPA, and its output is the reference's."""
    qkv, positions, cos, sin, k_cache, v_cache, common = rope_step_case([4], [(0, 20)], torch.float32)
    assert not cpu_kernels.supports_prefill_attention(qkv, k_cache, v_cache, 9)
    with pytest.raises(ValueError, match="cannot take"):
        cpu_kernels.cpu_prefill_attention(torch.empty(21, 9, 64), qkv, k_cache, v_cache,
                                          cpu_kernels.prefill_plan(common.prefills, common.slot_mapping),
                                          common.scale, 9)


def hf_rms_norm(x, weight, eps):
    """HF LlamaRMSNorm: float32 statistics, normalised value rounded to the input dtype, then scaled."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("num_rows", [1, 7, 300])
def test_rms_norm_equals_hf_in_bf16(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    x = (3 * torch.randn(num_rows, 600, generator=gen)).bfloat16()[:, :576]  # strided rows, as a residual slice
    weight = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    assert cpu_kernels.supports_rms_norm(x, weight)
    out = cpu_kernels.cpu_rms_norm(x, (576,), weight, 1e-5)
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, 576)
    torch.testing.assert_close(out, hf_rms_norm(x, weight, 1e-5), atol=0, rtol=2**-7)  # at most one bf16 ulp


def test_rms_norm_float32_close_to_hf():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5000, 64, generator=gen), torch.rand(64, generator=gen) + 0.5  # 5000 rows: threaded
    assert cpu_kernels.supports_rms_norm(x, weight)
    torch.testing.assert_close(cpu_kernels.cpu_rms_norm(x, (64,), weight, 1e-6), hf_rms_norm(x, weight, 1e-6))


def fused_reference(x, weight, bias, op, other):
    """The float32 sum, the op on it, one rounding to bf16: what oneDNN's fused post-ops give."""
    y = x.float() @ weight.float().T + (0 if bias is None else bias.float())
    y = {"none": y, "silu": F.silu(y), "mul": y * (other.float() if other is not None else 0),
         "add": y + (other.float() if other is not None else 0)}[op]
    return y.bfloat16()


@pytest.mark.parametrize("op", ["none", "silu", "mul", "add"])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 8, 13, 31, 32, 33, 64, 65, 100])
@pytest.mark.parametrize("shape", [(960, 576), (32, 64), (8, 64), (1537, 576), (7, 40)],
                         ids=["qkv", "tiny-unthreaded", "eight-rows", "odd-rows", "odd-both"])
def test_small_batch_linear_matches_float32_sum_rounded_once(op, num_rows, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 10 + num_rows)
    weight = (0.05 * torch.randn(n, k, generator=gen)).bfloat16()
    bias = (0.1 * torch.randn(n, generator=gen)).bfloat16() if n == 960 else None  # Qwen2's QKV bias
    x = torch.randn(num_rows, k + 5, generator=gen).bfloat16()[:, :k]  # strided rows
    other = torch.randn(num_rows, n + 3, generator=gen).bfloat16()[:, :n] if op in ("mul", "add") else None
    prepared = cpu_kernels.prepare_linear_weight(weight)
    if prepared is None:  # the packed layout (AVX512-BF16 builds) takes whole panels of 32 rows and 32 columns
        assert cpu_kernels.weight_packed() and (n % 32 or k % 32)
        return
    row_major_limit = cpu_kernels.limits().linear_max_rows
    if num_rows > row_major_limit and not (cpu_kernels.weight_packed() or cpu_kernels.row_major_any_rows()):
        return  # row-major, the kernel refuses them (below)
    expected = fused_reference(x, weight, bias, op, other)
    # AVX2 builds: the panels from their row count as shipped, from the first row, and (up to the row-major limit)
    # never; other builds have one path (-1)
    shipped = cpu_kernels.set_linear_panel_rows(0)
    if shipped != -1:
        cpu_kernels.set_linear_panel_rows(shipped)
    arms = [None] if shipped == -1 else [None, 1, row_major_limit + 1]
    for panel_rows in arms:
        before = None if panel_rows is None else cpu_kernels.set_linear_panel_rows(panel_rows)
        try:
            if panel_rows is not None and num_rows >= panel_rows > row_major_limit:
                continue
            out = cpu_kernels.cpu_linear_small(x, prepared, bias, op, other)
        finally:
            if before is not None:
                cpu_kernels.set_linear_panel_rows(before)
        assert out.shape == (num_rows, n) and out.dtype == torch.bfloat16
        # The sum order differs from torch's: a result may land on the neighbouring bf16 value, never further.
        torch.testing.assert_close(out, expected, atol=1e-3, rtol=2**-7,
                                   msg=lambda m, rows=panel_rows: f"panels from {rows}: {m}")


def test_small_batch_linear_refuses_more_rows_than_it_holds_row_major():
    if cpu_kernels.weight_packed() or cpu_kernels.row_major_any_rows():
        pytest.skip("packed weights, or AVX2's panels: every row count is taken (test_small_batch_linear_matches_...)")
    weight = cpu_kernels.prepare_linear_weight(torch.zeros(8, 64).bfloat16())
    too_many = cpu_kernels.limits().linear_max_rows + 1
    with pytest.raises(ValueError, match=f"cannot take {too_many} rows"):
        cpu_kernels.cpu_linear_small(torch.zeros(too_many, 64).bfloat16(), weight)


@pytest.mark.parametrize("op", ["none", "silu", "mul", "add"])
@pytest.mark.parametrize("num_rows", [1, 13, 32, 33, 64, 100])
@pytest.mark.parametrize("shape", [(960, 576), (64, 1536)], ids=["qkv", "down"])
def test_amx_linear_matches_float32_sum_rounded_once(op, num_rows, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n + num_rows)
    weight = (0.05 * torch.randn(n, k, generator=gen)).bfloat16()
    if not cpu_kernels.has_amx():
        pytest.skip("no AMX on this CPU (or in this build): linear_small runs these rows")
    prepared = cpu_kernels.prepare_linear_weight(weight)  # the one copy linear_small reads too
    bias = (0.1 * torch.randn(n, generator=gen)).bfloat16() if n == 960 else None
    x = torch.randn(num_rows, k + 5, generator=gen).bfloat16()[:, :k]  # strided rows; 1, 13, 33, 100: padded
    other = torch.randn(num_rows, n + 3, generator=gen).bfloat16()[:, :n] if op in ("mul", "add") else None
    out = cpu_kernels.cpu_linear_amx(x, prepared, bias, op, other)
    assert out.shape == (num_rows, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, fused_reference(x, weight, bias, op, other), atol=1e-3, rtol=2**-7)


def test_model_linear_holds_one_copy_and_routes_every_row_count_to_a_kernel_of_its_layout():
    from backend.engine.linear import SMALL_BATCH_ROWS, Kernel, Layout, Linear, c_layout, route
    from backend.engine.linear import SMALL_BATCH_ROWS_WITH_AMX as WITH_AMX

    gen = torch.Generator().manual_seed(1)
    weight = (0.05 * torch.randn(64, 576, generator=gen)).bfloat16()
    linear = Linear(weight)
    assert linear.layout is c_layout() and vars(linear).keys() == {"weight", "bias", "layout"}
    torch.testing.assert_close(linear.dense_weight(), weight, atol=0, rtol=0)
    for num_rows in (1, WITH_AMX, SMALL_BATCH_ROWS + 1, 32, 64, 65, 200):
        x = torch.randn(num_rows, 576, generator=gen).bfloat16()
        up = torch.randn(num_rows, 64, generator=gen).bfloat16()
        torch.testing.assert_close(linear(x), fused_reference(x, weight, None, "none", None), atol=1e-3, rtol=2**-7)
        torch.testing.assert_close(linear.mul(x, up), fused_reference(x, weight, None, "mul", up), atol=1e-3,
                                   rtol=2**-7)
    if linear.layout is Layout.ROW_MAJOR and cpu_kernels.row_major_any_rows():  # AVX2 without AVX512-BF16
        assert route(4096, linear) is Kernel.C_SMALL
    elif linear.layout is Layout.ROW_MAJOR:  # no AVX2: the reference above the small kernel
        assert [route(n, linear) for n in (SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1)] == [Kernel.C_SMALL, Kernel.TORCH]
    elif cpu_kernels.has_amx():
        assert [route(n, linear) for n in (WITH_AMX, WITH_AMX + 1, 4096)] == [Kernel.C_SMALL, Kernel.C_AMX,
                                                                               Kernel.C_AMX]
    else:
        assert route(4096, linear) is Kernel.C_SMALL


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.timeout(600)
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the baseline ISA below is x86-64's")
def test_kernels_forward_and_greedy_engine_hold_without_avx512_or_amx(tmp_path):
    """The suite must not depend on AVX-512 or AMX: with the C kernels built for x86-64-v2 (no AVX at all) and torch
    and oneDNN held to their baseline code paths, the kernel and sampler tests, the forward tests and the engine's
    greedy text against HF still pass, in a process of their own."""
    env = {**os.environ, "LLM_CPU_MARCH": "x86-64-v2", "XDG_CACHE_HOME": str(tmp_path),
           "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    tests = ["tests/unit/test_cpu_kernel.py", "tests/unit/test_sampler.py", "tests/unit/test_model_forward.py",
             "tests/unit/test_engine.py", "tests/unit/test_quantized_linear.py", "tests/unit/test_quantized_model.py",
             "-k", "not without_avx512 and (not test_engine or greedy_matches_hf or min_tokens)"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env,
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=550)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert list(tmp_path.rglob("cpu_kernels-*.so")), "the kernels were not rebuilt for the baseline ISA"


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.timeout(600)
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the ISA below is x86-64's")
def test_kernels_forward_and_greedy_engine_hold_on_avx2_without_avx512(tmp_path):
    """A CPU with AVX2 and FMA but no AVX-512 (Zen 2 and 3, most client CPUs) runs the projections' panels
    (``linear_rows_avx2``) at every row count above a decode's, and the decode attention's 8-float path
    (``score_avx2``, ``weigh_values_avx2``): built for x86-64-v3 in a process of their own, with torch and oneDNN held
    to AVX2, the projection, attention and kernel tests, the forward tests and the engine's greedy text against HF
    pass, whatever this machine's own CPU."""
    env = {**os.environ, "LLM_CPU_MARCH": "x86-64-v3", "XDG_CACHE_HOME": str(tmp_path),
           "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    check = ("from backend.kernels import cpu_kernels as k; from backend.engine.linear import Layout, c_layout; "
             "assert k.row_major_any_rows() and c_layout() is Layout.ROW_MAJOR and k.set_linear_panel_rows(5) == 5")
    built = subprocess.run([sys.executable, "-c", check], env=env, cwd=Path(__file__).resolve().parents[2],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    tests = ["tests/unit/test_cpu_kernel.py", "tests/unit/test_model_forward.py", "tests/unit/test_engine.py",
             "-k", "(linear or projection or attention or kernel_matches or forward or greedy_matches_hf) "
             "and not without_avx512 and not on_avx2"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env,
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=550)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and list(tmp_path.rglob("cpu_kernels-*.so"))


# Each is a set of the kernels' #if branches: AMX and AVX512-BF16 (Xeon 4th gen on), AVX512-BF16 and VNNI without AMX
# (the path Zen 4 takes), VNNI without BF16, and AVX-512 with neither.
OTHER_X86_TARGETS = ("sapphirerapids", "cooperlake", "cascadelake", "x86-64-v4")


def _compiler_knows(march: str) -> bool:
    probe = subprocess.run([cpu_kernels.compiler(), f"-march={march}", "-x", "c", "-c", "-o", os.devnull,
                            os.devnull], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the targets below are x86-64's")
@pytest.mark.parametrize("march", OTHER_X86_TARGETS)
def test_the_kernels_compile_and_export_every_function_for_x86_cpus_this_one_is_not(tmp_path, march):
    """The library is built for the CPU it runs on, so code behind ``__AMX_TILE__`` or ``__AVX512BF16__`` is never
    compiled on a CPU without them, and the tests that run it cannot run there. Built for each other target, it
    compiles and every function the engine declares is there (loaded in a process of its own, where none of it runs):
    a change made on one CPU cannot break the build on another."""
    if not _compiler_knows(march):
        pytest.skip(f"{cpu_kernels.compiler()} does not know -march={march}")
    built = tmp_path / f"cpu_kernels-{march}.so"
    try:
        cpu_kernels.compile_library(built, march)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"the kernels do not compile for -march={march}:\n{exc.stderr.decode()[-4000:]}")
    declare = "import ctypes, sys; from backend.kernels import cpu_kernels as k; k._declare(ctypes.CDLL(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", declare, str(built)], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.smollm2
@pytest.mark.skipif(not cpu_kernels.row_major_any_rows(), reason="no AVX2 panels in this build (AVX512-BF16, no AVX2)")
def test_the_avx2_linear_bench_records_the_panels_beside_the_route_before(smollm2_dir):
    """``bench.avx2_linear`` times projections and real engine steps with the route before the panels (to 8 rows in
    registers, torch's bf16 matmul above) and as shipped, records them side by side, and leaves the route as shipped."""
    from backend.engine import linear
    from backend.engine.config import ModelShape
    from bench import avx2_linear

    model_shape = ModelShape.from_model_dir(smollm2_dir)
    shapes = avx2_linear.shapes(model_shape)
    assert shapes["qkv"] == (960, 576) and shapes["lm_head"] == (model_shape.vocab_size, 576)
    projections = avx2_linear.projection_ms({"o": shapes["o"], "odd": (100, 70)}, [1, 9], rounds=1)
    steps = avx2_linear.step_ms(str(smollm2_dir), rounds=1, prefill=(2, 8), batches=(9,))
    assert [(r["projection"], r["rows"]) for r in projections] == [("o", 1), ("o", 9), ("odd", 1), ("odd", 9)]
    assert [r["step"] for r in steps] == ["prefill 2 x 8", "decode 9"]
    record = avx2_linear.record_tables(avx2_linear.Record("python -m bench.avx2_linear", {}, {}), projections, steps)
    assert all(r["before"] > 0 and r["ratio"] == pytest.approx(r["panels"] / r["before"])
               for name in ("projections", "steps") for r in record.tables[name].rows)
    assert linear.small_rows_limit(linear.Layout.ROW_MAJOR) > 4096 and cpu_kernels.set_linear_panel_rows(5) == 5
    with avx2_linear.route_before():
        assert linear.small_rows_limit(linear.Layout.ROW_MAJOR) == linear.SMALL_BATCH_ROWS


@pytest.mark.smollm2
@pytest.mark.skipif(not cpu_kernels.prefill_attention_available(),
                    reason="the prefill kernel needs AVX512-BF16, or AVX2 and FMA")
def test_the_prefill_bench_records_the_kernel_beside_sdpa(smollm2_dir):
    """``bench.prefill_attention`` times real prefill steps with each backend and records them side by side."""
    from bench import prefill_attention

    rows = prefill_attention.prefill_step_ms(str(smollm2_dir), [(2, 16), (1, 40)], rounds=1)
    assert [(r["prompts"], r["tokens"]) for r in rows] == [(2, 16), (1, 40)]
    record = prefill_attention.record_table(prefill_attention.Record("python -m bench.prefill_attention", {}, {}),
                                            rows)
    table = record.tables["prefill"]
    assert [c.key for c in table.columns] == ["prompts", "tokens", "sdpa", "kernel", "ratio"]
    assert all(r["sdpa"] > 0 and r["ratio"] == pytest.approx(r["kernel"] / r["sdpa"]) for r in table.rows)
    with pytest.raises(Exception, match="PROMPTSxTOKENS"):
        prefill_attention.parse_shape("four")


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels are not built here")
def test_a_projection_is_the_same_whichever_thread_takes_its_panels():
    """The projections' loop goes out by OpenMP's run schedule (``dynamic,1`` as shipped): each panel's sums are the
    same whichever thread computes them, so the output equals the static split's bit for bit."""
    from backend.engine.openmp import run_schedule, set_run_schedule

    before = run_schedule()
    torch.manual_seed(0)
    weight = cpu_kernels.prepare_linear_weight(torch.randn(1536, 576, dtype=torch.bfloat16) * 0.05)
    other = torch.randn(300, 1536, dtype=torch.bfloat16)
    try:
        most = 300 if cpu_kernels.weight_packed() else cpu_kernels.limits().linear_max_rows  # row-major: its limit
        for rows in (1, 7, most):
            x = torch.randn(rows, 576, dtype=torch.bfloat16)
            outputs = []
            for kind, chunk in (("static", 0), ("dynamic", 1), ("guided", 0)):
                set_run_schedule(kind, chunk)
                assert run_schedule()[0] == kind
                outputs.append(cpu_kernels.cpu_linear_small(x, weight, op="mul", other=other[:rows]))
            assert all(torch.equal(outputs[0], out) for out in outputs[1:]), rows
    finally:
        set_run_schedule(*before)


@pytest.mark.smollm2
def test_the_omp_schedule_bench_records_both_arms(smollm2_dir):
    """``bench.omp_schedule`` times real prefill and decode steps under each schedule and records them side by side."""
    from backend.engine.openmp import run_schedule
    from bench import omp_schedule

    before = run_schedule()
    figures = omp_schedule.step_ms(str(smollm2_dir), rounds=1, decode_batches=(3,), prompts=2, prompt_len=16)
    assert run_schedule() == before  # the process's schedule is left as it was
    assert set(figures) == {"prefill", "decode 3"}
    assert all(set(arms) == {"static", "dynamic"} and min(arms.values()) > 0 for arms in figures.values())
    rows = [{"machine": "quiet", "workload": workload, **arms} for workload, arms in figures.items()]
    record = omp_schedule.record_table(omp_schedule.Record("python -m bench.omp_schedule", {}, {}), rows)
    table = record.tables["schedule"]
    assert [c.key for c in table.columns] == ["machine", "workload", "static", "dynamic", "ratio"]
    assert all(r["ratio"] == pytest.approx(r["dynamic"] / r["static"]) for r in table.rows)


@pytest.mark.smollm2
def test_the_decode_attention_bench_records_both_paths(smollm2_dir):
    """``bench.decode_attention`` times real decode steps and the kernel alone on each path, side by side, and leaves
    the process on the path it found."""
    from bench import decode_attention

    rows = decode_attention.step_ms(str(smollm2_dir), [(3, 16), (2, 40)], rounds=1)
    assert cpu_kernels.set_decode_attention_widened(False) is False  # put back as found
    assert [(r["batch"], r["prompt"]) for r in rows] == [(3, 16), (2, 40)]
    record = decode_attention.record_table(decode_attention.Record("python -m bench.decode_attention", {}, {}), rows)
    table = record.tables["decode"]
    assert [c.key for c in table.columns] == ["batch", "prompt", "widened", "direct", "step_ratio",
                                              "widened_attention", "direct_attention", "attention_ratio"]
    assert all(min(r["widened"], r["direct"], r["widened_attention"], r["direct_attention"]) > 0 and
               r["step_ratio"] == pytest.approx(r["direct"] / r["widened"]) for r in table.rows)
