"""The paged forward's logits equal HF transformers' on the same weights (tiny random Llama, fp32).

Blocks are handed out by hand, scattered and out of order, so every sequence crosses block boundaries in
non-contiguous physical blocks; the model has grouped-query attention (4 query heads, 2 KV heads).
"""

from __future__ import annotations

import random

import pytest
import torch

from backend.engine.config import EngineConfig
from backend.engine.model_runner import ModelInput, ModelRunner
from backend.engine.request import Request
from backend.engine.scheduler import ScheduledRequest

BLOCK_SIZE = 4
ATOL = 2e-4


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=128,
        max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, num_threads=2,
    )
    return ModelRunner(config.resolve())


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def hf_last_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0, -1].float()


class BlockPool:
    """Hands out physical blocks in a shuffled order, so block tables are scattered."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def cover(self, request: Request, num_tokens: int) -> None:
        while len(request.block_ids) * BLOCK_SIZE < num_tokens:
            request.block_ids.append(self.free.pop())


def run_step(runner: ModelRunner, pool: BlockPool, scheduled: list[tuple[Request, int]]) -> dict[str, torch.Tensor]:
    for request, n in scheduled:
        pool.cover(request, request.num_computed_tokens + n)
    inputs = runner.prepare([ScheduledRequest.of(request, n) for request, n in scheduled])
    logits = runner.run(inputs)
    for request, n in scheduled:
        request.num_computed_tokens += n
    return {r.request_id: row for r, row in zip(inputs.sampled_requests, logits)}


def prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = random.Random(seed)
    return [[gen.randrange(vocab) for _ in range(n)] for n in lengths]


# ---- a decode step through the decode stack (here and in test_quantized_model) ----------------------------------


def decode_runner(model_dir, quantization: str | None = None) -> ModelRunner:
    """A bf16 runner of the tiny model (``quantization``: its projections' weights), room for 64 requests a step."""
    config = EngineConfig(
        model=str(model_dir), dtype="bfloat16", quantization=quantization, block_size=BLOCK_SIZE, num_kv_blocks=128,
        max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=256, num_threads=2,
    )
    return ModelRunner(config.resolve())


def decode_inputs(runner: ModelRunner, lengths: list[int]) -> ModelInput:
    """The inputs of a decode-only step: requests whose prompts (``lengths`` tokens) were prefilled in a step before,
    layer by layer, each with one token appended."""
    pool = BlockPool(runner.num_kv_blocks)
    requests = [Request(f"r{i}", p) for i, p in enumerate(prompts(runner.shape.vocab_size, lengths))]
    run_step(runner, pool, [(r, len(r.prompt_token_ids)) for r in requests])
    for r in requests:
        r.append_token(7)
        pool.cover(r, r.num_computed_tokens + 1)
    return runner.prepare([ScheduledRequest.of(r, 1) for r in requests])


class CountedStack:
    """A decode stack that counts its calls."""

    def __init__(self, stack) -> None:
        self.stack, self.weight_format, self.num_calls = stack, stack.weight_format, 0

    def __call__(self, *args):
        self.num_calls += 1
        return self.stack(*args)


def test_prefill_then_batched_decode_match_hf(runner, hf_model):
    pool = BlockPool(runner.num_kv_blocks)
    lengths = [7, 13, 5, 16, 1]
    requests = [Request(f"r{i}", p) for i, p in enumerate(prompts(runner.shape.vocab_size, lengths))]
    logits = run_step(runner, pool, [(r, r.num_tokens) for r in requests])
    for r in requests:
        torch.testing.assert_close(logits[r.request_id], hf_last_logits(hf_model, r.token_ids), atol=ATOL, rtol=0)
    for _ in range(6):  # decodes: sequences of mixed lengths in one batch, crossing block boundaries
        for r in requests:
            r.append_token(int(logits[r.request_id].argmax()))
        logits = run_step(runner, pool, [(r, 1) for r in requests])
        for r in requests:
            torch.testing.assert_close(logits[r.request_id], hf_last_logits(hf_model, r.token_ids), atol=ATOL, rtol=0)


def test_chunked_prefill_mixed_with_decode_matches_hf(runner, hf_model):
    pool = BlockPool(runner.num_kv_blocks, seed=2)
    long_prompt, short_prompt = prompts(runner.shape.vocab_size, [23, 6], seed=3)
    long, short = Request("long", long_prompt), Request("short", short_prompt)
    logits = run_step(runner, pool, [(short, short.num_tokens), (long, 5)])  # long: first chunk, not sampled
    assert set(logits) == {"short"}
    short.append_token(int(logits["short"].argmax()))
    logits = run_step(runner, pool, [(short, 1), (long, 9)])  # a decode and a middle chunk in one step
    short.append_token(int(logits["short"].argmax()))
    logits = run_step(runner, pool, [(short, 1), (long, 9)])  # the last chunk reaches the end: sampled
    torch.testing.assert_close(logits["long"], hf_last_logits(hf_model, long.token_ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits["short"], hf_last_logits(hf_model, short.token_ids), atol=ATOL, rtol=0)
    long.append_token(int(logits["long"].argmax()))
    logits = run_step(runner, pool, [(long, 1)])
    torch.testing.assert_close(logits["long"], hf_last_logits(hf_model, long.token_ids), atol=ATOL, rtol=0)


def test_prefill_over_cached_prefix_matches_hf(runner, hf_model):
    """A chunk attends to K/V already in the cache (as after a prefix-cache hit or a resumed preemption)."""
    pool = BlockPool(runner.num_kv_blocks, seed=4)
    (prompt,) = prompts(runner.shape.vocab_size, [19], seed=5)
    r = Request("p", prompt)
    run_step(runner, pool, [(r, 8)])  # two full blocks cached
    logits = run_step(runner, pool, [(r, 11)])
    torch.testing.assert_close(logits["p"], hf_last_logits(hf_model, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("batch", [1, 3, 8, 9, 40])
def test_decode_stack_equals_the_layer_by_layer_forward_to_the_bit(tiny_llama_dir, batch, monkeypatch):
    """A decode-only step in bf16 whose projections all route to C (``linear.route``: up to the library's row
    limit with packed weights or AVX2's panels, SMALL_BATCH_ROWS row-major without AVX2) runs every layer in one C
    call (``DecodeStack``); the same step run layer by layer (the same C kernels called from Python) gives the same
    logits exactly, and the reference ``F.linear`` on the weights read back gives them within bf16 rounding."""
    from backend.engine import linear
    from backend.kernels import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C compiler: the torch path is used")
    runner = decode_runner(tiny_llama_dir)
    stack = runner.model.decode_stack
    assert stack is not None, "the tiny model's shapes fit the C kernels: the stack must be built"
    inputs = decode_inputs(runner, ([5, 9, 14, 3, 7, 11, 2, 6] * 8)[:batch])
    counted = CountedStack(stack)

    def decode(decode_stack, c_paths=True):
        monkeypatch.setattr(runner.model, "decode_stack", decode_stack)
        for limit in ("small_rows_limit", "c_rows_limit"):  # 0: route sends no row to C
            monkeypatch.setattr(linear, limit, getattr(linear, limit) if c_paths else lambda layout: 0)
        return runner.run(inputs).clone()  # the step writes the same K/V again: runs are independent

    stacked = decode(counted)
    if batch > linear.c_rows_limit(linear.c_layout()):  # F.linear's rows: layer by layer
        assert counted.num_calls == 0
        return
    assert counted.num_calls, "the step did not take the decode stack"
    by_layer = decode(None)
    torch.testing.assert_close(stacked, by_layer, atol=0, rtol=0)
    reference = decode(None, c_paths=False)
    torch.testing.assert_close(stacked.float(), reference.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("rope", [
    {}, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
], ids=["default", "linear", "dynamic", "llama3", "yarn"])
def test_rope_tables_equal_hf_rotary_class_to_the_bit(tiny_llama_dir, rope):
    """The static rope types' tables are computed without HF's Llama module (whose import costs an engine 190 MiB):
    they must be HF's own, bit for bit."""
    from transformers import AutoConfig

    from backend.engine import model

    config = AutoConfig.from_pretrained(str(tiny_llama_dir))
    config.max_position_embeddings = 4096
    if rope:
        config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], **rope}
    shape = type("Shape", (), {"hf_config": config.to_dict()})
    ours = model._rope_tables(shape, 3000, torch.device("cpu"))
    hf = model._hf_rope_tables(AutoConfig.for_model(**config.to_dict()), 3000, torch.device("cpu"))
    assert torch.equal(ours[0], hf[0]) and torch.equal(ours[1], hf[1])
