"""The OpenAI Triton kernels in backend/kernels give the torch reference's results on the same inputs.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors (set below, before ``backend.kernels``
decorates them); with one, the same tests run the compiled kernels on CUDA tensors (``make gpu-check``).

Every paged layout here is scattered: blocks are handed out shuffled, the whole pool (unused blocks included) holds
random values, and block tables are padded with block 0, so reading a position outside a context shows as an error.

Tolerances, against the reference computed in float32 from the same (rounded) inputs:
- float32: atol 2e-5, rtol 1e-5 (the kernels use exact fp32 products, not TF32);
- bfloat16: atol 1.6e-2, rtol 1.6e-2 (the output is rounded to bf16, 2^-8 relative, and the softmax weights are
  rounded to bf16 before they multiply V, as in flash-attention);
- the KV write is exact (``torch.equal``).
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of backend.kernels

from backend import kernels
from backend.engine.attention import CpuAttention, TorchAttention, select_attention_backend
from backend.engine.attention.torch_backend import paged_decode_attention, prefill_attention, write_kv
from backend.engine.attention.triton_backend import TritonAttention
from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.model_runner import ModelRunner
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import ScheduledRequest
from backend.kernels import cpu_kernels
from backend.kernels._common import is_interpreted
from backend.kernels.decode_attention import _decode_kernel
from tests.attention_cases import rope_step_case

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not is_interpreted(_decode_kernel):
    pytest.fail(
        "backend.kernels was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run on this CPU; "
        "run this module on its own or set TRITON_INTERPRET=1 in the environment",
        pytrace=False,
    )

TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
BF16 = pytest.param(torch.bfloat16, id="bf16")
FP32 = pytest.param(torch.float32, id="fp32")


def case_id(case) -> str:
    ratio, head_dim, block_size, dtype = case
    return f"gqa{ratio}-hd{head_dim}-bs{block_size}-{'bf16' if dtype == torch.bfloat16 else 'fp32'}"


class PagedPool:
    """A KV pool of random values whose blocks are handed out in shuffled order."""

    def __init__(self, num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = (2 * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def allocate(self, num_tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-num_tokens // self.block_size))]

    def block_tables(self, context_lens: list[int]) -> torch.Tensor:  # [B, max_blocks] int32, padded with 0
        tables = [self.allocate(n) for n in context_lens]
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)

    def slots(self, table: list[int], num_tokens: int) -> torch.Tensor:  # flat slots of positions 0..num_tokens-1
        bs = self.block_size
        return torch.tensor([table[p // bs] * bs + p % bs for p in range(num_tokens)], dtype=torch.long, device=DEVICE)

    def as_float(self):
        return self.k_cache.float(), self.v_cache.float()


def heads(ratio: int) -> tuple[int, int]:
    """(query heads, KV heads) for a GQA ratio."""
    num_kv_heads = 1 if ratio == 8 else 2
    return ratio * num_kv_heads, num_kv_heads


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


# ---- KV write -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("num_kv_heads, head_dim, block_size", [(1, 64, 16), (3, 128, 32), (8, 64, 32)])
def test_write_kv_matches_reference(num_kv_heads, head_dim, block_size, dtype):
    pool = PagedPool(12, block_size, num_kv_heads, head_dim, dtype)
    slots = torch.randperm(12 * block_size, generator=torch.Generator().manual_seed(1))[:40].to(DEVICE)
    key = randn(40, num_kv_heads, head_dim, dtype=dtype, seed=2)
    value = randn(40, num_kv_heads, head_dim, dtype=dtype, seed=3)
    k_ref, v_ref = pool.k_cache.clone(), pool.v_cache.clone()
    write_kv(k_ref, v_ref, key, value, slots)
    kernels.cuda_write_kv(pool.k_cache, pool.v_cache, key, value, slots)
    assert torch.equal(pool.k_cache, k_ref) and torch.equal(pool.v_cache, v_ref)


def test_write_kv_reads_strided_views_and_skips_negative_slots():
    """V arrives as a strided view of the fused QKV output; a negative slot (padding) writes nothing."""
    pool = PagedPool(4, 16, 2, 64, torch.float32)
    qkv = randn(5, 3 * 2 * 64, dtype=torch.float32, seed=4)
    key, value = (t.view(5, 2, 64) for t in qkv.split(128, dim=-1)[1:])  # value is not contiguous
    slots = torch.tensor([3, 17, -1, 40, 63], device=DEVICE)
    k_before, v_before = pool.k_cache.clone(), pool.v_cache.clone()
    kernels.cuda_write_kv(pool.k_cache, pool.v_cache, key, value, slots)
    kept = slots >= 0
    write_kv(k_before, v_before, key[kept], value[kept], slots[kept])
    assert torch.equal(pool.k_cache, k_before) and torch.equal(pool.v_cache, v_before)


# ---- decode -------------------------------------------------------------------------------------------------------


def run_decode(ratio, head_dim, block_size, dtype, context_lens, num_splits=None, seed=0):
    num_heads, num_kv_heads = heads(ratio)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 4
    pool = PagedPool(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed)
    tables = pool.block_tables(context_lens)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    query = randn(len(context_lens), num_heads, head_dim, dtype=dtype, seed=seed + 1)
    scale = head_dim**-0.5
    out = kernels.cuda_decode_attention(query, pool.k_cache, pool.v_cache, tables, lens, scale, num_splits=num_splits)
    ref = paged_decode_attention(query.float(), *pool.as_float(), tables, lens, scale)
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])


DECODE_CASES = [  # (GQA ratio, head_dim, block_size, dtype): every ratio with both head dims, block sizes, dtypes
    (1, 64, 16, torch.float32),
    (1, 128, 32, torch.bfloat16),
    (3, 64, 32, torch.float32),
    (3, 128, 16, torch.bfloat16),
    (3, 64, 16, torch.bfloat16),
    (8, 128, 16, torch.float32),
    (8, 64, 32, torch.bfloat16),
    (8, 128, 32, torch.float32),
]


@pytest.mark.parametrize("ratio, head_dim, block_size, dtype", DECODE_CASES, ids=map(case_id, DECODE_CASES))
def test_decode_matches_reference(ratio, head_dim, block_size, dtype):
    """Mixed context lengths in one batch: one token, exactly one block, one past a block, and past a 64-tile."""
    run_decode(ratio, head_dim, block_size, dtype, [1, block_size, block_size + 1, 2 * block_size + 7])


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_context_decode_matches_reference(num_splits, dtype):
    """Flash-decoding: partial results per context range, merged; short sequences leave some ranges empty."""
    run_decode(3, 64, 16, dtype, [1, 17, 150, 300], num_splits=num_splits)


def test_long_context_decode_matches_reference():
    """A context of 2,000 positions, split (on a GPU the split count is chosen from the SM count)."""
    run_decode(3, 64, 32, torch.float32, [2000, 5], num_splits=None if DEVICE.type == "cuda" else 4)


# ---- prefill ------------------------------------------------------------------------------------------------------


PREFILL_CASES = [
    (1, 128, 16, torch.float32),
    (3, 64, 32, torch.bfloat16),
    (8, 64, 16, torch.bfloat16),
    (3, 128, 32, torch.float32),
]


@pytest.mark.parametrize("ratio, head_dim, block_size, dtype", PREFILL_CASES, ids=map(case_id, PREFILL_CASES))
@pytest.mark.parametrize("num_cached, num_query", [(0, 37), (45, 70)], ids=["fresh", "cached-prefix"])
def test_prefill_chunk_matches_reference(ratio, head_dim, block_size, dtype, num_cached, num_query):
    """A chunk of queries attends to its cached prefix (through the block table) plus itself, causally.

    70 queries span two 64-row query tiles; 45 cached positions end inside a block.
    """
    num_heads, num_kv_heads = heads(ratio)
    pool = PagedPool(16, block_size, num_kv_heads, head_dim, dtype)
    context = num_cached + num_query
    table = pool.allocate(context)
    slots = pool.slots(table, context)
    query = randn(num_query, num_heads, head_dim, dtype=dtype, seed=5)
    key = randn(num_query, num_kv_heads, head_dim, dtype=dtype, seed=6)
    value = randn(num_query, num_kv_heads, head_dim, dtype=dtype, seed=7)
    write_kv(pool.k_cache, pool.v_cache, key, value, slots[num_cached:])  # the step writes before it attends
    scale = head_dim**-0.5
    # the kernel reads the whole context, the chunk's own K/V included, through the block table (as the engine calls it)
    block_tables = torch.tensor([table], dtype=torch.int32, device=DEVICE)
    starts, lens, cached = torch.tensor([[0], [num_query], [num_cached]], dtype=torch.int32, device=DEVICE)
    out = kernels.paged_prefill_attention(query, pool.k_cache, pool.v_cache, block_tables, starts, lens, cached, scale,
                                          max_query_len=num_query)
    context_slots = slots if num_cached else None
    ref = prefill_attention(query.float(), key.float(), value.float(), *pool.as_float(), context_slots, scale)
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_whole_step_matches_reference(dtype):
    """One step as the model runner lays it out (three decodes, then a fresh chunk and a chunk over a cached prefix)
    through the Triton backend, from the QKV projection: the torch reference backend's output and pool."""
    qkv, positions, cos, sin, k_cache, v_cache, common = rope_step_case(
        [5, 16, 40], [(0, 20), (33, 40)], dtype, num_heads=6, num_kv_heads=2, device=DEVICE)
    k_ref, v_ref = k_cache.float().clone(), v_cache.float().clone()  # .float() of a float32 pool is that pool
    reference, backend = TorchAttention(), TritonAttention()
    ref = reference.forward(qkv.float(), positions, cos.float(), sin.float(), k_ref, v_ref,
                            reference.build_metadata(common), 6)
    out = backend.forward(qkv, positions, cos, sin, k_cache, v_cache, backend.build_metadata(common), 6)
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])
    torch.testing.assert_close(k_cache.float(), k_ref, **TOLERANCE[dtype])  # rotated in the dtype: rounding
    assert torch.equal(v_cache.float(), v_ref)  # values are copied


# ---- the model and the engine with attention on the kernels -------------------------------------------------------


def test_runner_picks_the_kernels_on_cuda_and_the_c_kernel_or_torch_on_cpu():
    assert type(select_attention_backend(torch.device("cuda"))) is TritonAttention
    expected = CpuAttention if cpu_kernels.load() is not None else TorchAttention
    assert type(select_attention_backend(torch.device("cpu"))) is expected


# Every backend the runner can choose on this device (the torch reference is what they are compared with).
BACKENDS = [pytest.param(TritonAttention(), id="triton")]
if DEVICE.type == "cpu" and cpu_kernels.load() is not None:
    BACKENDS.append(pytest.param(CpuAttention(), id="cpu-c"))


@pytest.mark.parametrize("attention", BACKENDS)
def test_model_forward_logits_match_reference_through_a_step_sequence(tiny_llama_dir, attention):
    """The tiny Llama's forward (fp32), its attention through the runner's hook, gives the torch reference's logits
    over prefill, chunked prefill mixed with decodes, then decodes only; the runner builds each backend's metadata.

    Step 1: two fresh 16-token chunks (batched together on the torch path), a fresh 20-token prompt, a 1-token prompt.
    Step 2: three decodes and the second chunk (24 tokens) of the 40-token prompt over its cached 16.
    Step 3: four decodes. Blocks are handed out shuffled; each sampled request appends a fixed token.
    """
    config = EngineConfig(
        model=str(tiny_llama_dir), device=DEVICE.type, dtype="float32", block_size=16, num_kv_blocks=16,
        max_num_seqs=4, max_num_batched_tokens=128, max_model_len=128, num_threads=2,
    )
    runner = ModelRunner(config.resolve())

    def run_steps() -> list[torch.Tensor]:
        prompts = {"a": 20, "b": 40, "c": 1, "d": 16}
        block_ids = iter(random.Random(0).sample(range(config.num_kv_blocks), config.num_kv_blocks))
        requests = {}
        for name, n in prompts.items():
            requests[name] = r = Request(name, [(13 * i + 5 * n) % 1000 + 1 for i in range(n)])
            r.block_ids = [next(block_ids) for _ in range(-(-(n + 3) // 16))]
        steps = [{"b": 16, "d": 16, "a": 20, "c": 1}, {"a": 1, "c": 1, "d": 1, "b": 24}, dict.fromkeys("abcd", 1)]
        runner.kv_caches = runner._allocate_kv_caches(config.num_kv_blocks)
        logits = []
        for number, step in enumerate(steps):
            inputs = runner.prepare([ScheduledRequest.of(requests[name], n) for name, n in step.items()])
            logits.append(runner.run(inputs).float().cpu())
            for name, n in step.items():
                requests[name].num_computed_tokens += n
            for r in inputs.sampled_requests:
                r.token_ids.append(100 + number)
        assert [len(step) for step in logits] == [3, 4, 4]
        return logits

    runner.model.attention = TorchAttention()
    reference = run_steps()
    runner.model.attention = attention
    for got, want in zip(run_steps(), reference):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_engine_greedy_tokens_equal_with_kernels(tiny_llama_dir):
    """The engine (tiny random Llama, fp32) generates the same greedy tokens with the kernels as with the torch path.

    A token budget of 16 forces chunked prefill over a cached prefix, mixed with decodes, across blocks of 16.
    """
    config = dict(
        model=str(tiny_llama_dir), device=DEVICE.type, dtype="float32", block_size=16, num_kv_blocks=64,
        max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, num_threads=2,
    )
    prompts = [[(7 * i + 3) % 1000 + 1 for i in range(n)] for n in (3, 21, 40)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(EngineConfig(**config))
    engine.runner.model.attention = TorchAttention()  # on CUDA the runner would pick the kernels
    reference = [c.token_ids for c in engine.generate(prompts, params)]
    engine = LLMEngine(EngineConfig(**config))
    engine.runner.model.attention = TritonAttention()
    assert [c.token_ids for c in engine.generate(prompts, params)] == reference
