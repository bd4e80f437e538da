"""A step that carries prefill chunks beside decodes gives what its parts give run separately.

The logits are compared in float32 on the tiny random Llama (a model against itself, with a tolerance for the
matmuls' blocking at another row count); the engine's tokens are compared greedily with ``ignore_eos``; the AMX
projection, whose last partial group of 32 rows is padded on its own, is compared with itself at another row count.
No figure here depends on one CPU's bf16 rounding, and nothing is timed.
"""

from __future__ import annotations

import random

import pytest
import torch

from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.model_runner import ModelRunner
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import ScheduledRequest
from backend.kernels import cpu_kernels

ATOL = 1e-4  # float32: the same sums, blocked differently at another row count


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", block_size=4, num_kv_blocks=256,
                          max_num_seqs=16, max_num_batched_tokens=512, max_model_len=256, num_threads=2)
    return ModelRunner(config.resolve())


class Blocks:
    """Physical blocks handed out in a shuffled order, so block tables are scattered."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.free, self.block_size = list(range(num_blocks)), block_size
        random.Random(0).shuffle(self.free)

    def cover(self, request: Request, num_tokens: int) -> None:
        while len(request.block_ids) * self.block_size < num_tokens:
            request.block_ids.append(self.free.pop())


def logits_of(runner: ModelRunner, blocks: Blocks, step: list[tuple[Request, int]]) -> dict[str, torch.Tensor]:
    """One forward over ``step`` (request, tokens to run); the requests are left where they were, so the same step
    can run again (it writes the same K/V to the same slots)."""
    for request, n in step:
        blocks.cover(request, request.num_computed_tokens + n)
    inputs = runner.prepare([ScheduledRequest.of(request, n) for request, n in step])
    logits = runner.run(inputs)
    return {r.request_id: row.clone() for r, row in zip(inputs.sampled_requests, logits)}


def advance(step: list[tuple[Request, int]], logits: dict[str, torch.Tensor]) -> None:
    for request, n in step:
        request.num_computed_tokens += n
        if request.request_id in logits:
            request.append_token(int(logits[request.request_id].argmax()))


@pytest.mark.parametrize("num_decodes", [1, 5, 12])
def test_mixed_step_logits_equal_its_parts_run_separately(runner, num_decodes):
    vocab, rng = runner.shape.vocab_size, random.Random(num_decodes)
    blocks = Blocks(runner.num_kv_blocks, runner.block_size)
    decodes = [Request(f"d{i}", [rng.randrange(vocab) for _ in range(rng.randint(3, 30))]) for i in range(num_decodes)]
    prefill = [(r, r.num_tokens) for r in decodes]
    advance(prefill, logits_of(runner, blocks, prefill))  # each now has one token to run: a decode
    fresh = Request("fresh", [rng.randrange(vocab) for _ in range(37)])  # a whole prompt, sampled
    middle = Request("middle", [rng.randrange(vocab) for _ in range(50)])  # a chunk over a cached prefix, not sampled
    advance([(middle, 9)], logits_of(runner, blocks, [(middle, 9)]))
    last = Request("last", [rng.randrange(vocab) for _ in range(45)])  # the chunk that ends a prompt over its prefix
    advance([(last, 20)], logits_of(runner, blocks, [(last, 20)]))

    decode_step = [(r, 1) for r in decodes]
    chunks = [(fresh, fresh.num_tokens), (middle, 23), (last, last.num_tokens - 20)]
    alone = logits_of(runner, blocks, decode_step)
    for chunk in chunks:
        alone.update(logits_of(runner, blocks, [chunk]))
    mixed = logits_of(runner, blocks, decode_step + chunks)

    # logits only where a sequence samples: every decode, and the chunks that reach the end of their prompt
    assert set(mixed) == {r.request_id for r in decodes} | {"fresh", "last"} == set(alone)
    for request_id, row in mixed.items():
        torch.testing.assert_close(row, alone[request_id], atol=ATOL, rtol=0, msg=request_id)


def test_engine_tokens_with_mixed_steps_equal_each_request_alone(tiny_llama_dir):
    """Requests arriving while others decode, under a small token budget: their prompts are chunked into steps
    beside the running decodes, and every request's tokens are those it gets alone."""
    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", block_size=4, num_kv_blocks=256,
                                      max_num_seqs=8, max_num_batched_tokens=24, max_model_len=256, num_threads=2))

    rng = random.Random(3)
    vocab = 49152
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(n)] for n in (5, 40, 17, 61, 3, 29)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = engine()
    expected = [alone.generate([p], params)[0].token_ids for p in prompts]

    together = engine()
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):  # one arrival every two steps
        together.add_request(f"r{i}", prompt, params)
        for _ in range(2):
            for out in together.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    while together.has_unfinished():
        for out in together.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    steps = together.stats.recent_steps()
    assert any(s.num_decodes and s.num_tokens > s.num_seqs for s in steps), "no step mixed a chunk with decodes"
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("num_rows", [33, 100, 1055])
def test_amx_projection_of_a_row_does_not_depend_on_the_rows_beside_it(num_rows):
    """The AMX kernel pads only a last, partial group of 32 rows: the full groups are read in place. Each output row
    depends on its own input row only, so a row comes out the same in a step of ``num_rows`` rows as in one of a
    multiple of 32 (the kernel against itself: the same sums in the same order)."""
    if not cpu_kernels.has_amx():
        pytest.skip("no AMX on this CPU (or in this build)")
    gen = torch.Generator().manual_seed(num_rows)
    weight = cpu_kernels.prepare_linear_weight((0.05 * torch.randn(256, 576, generator=gen)).bfloat16())
    x = torch.randn(num_rows, 576 + 8, generator=gen).bfloat16()[:, :576]  # strided rows, as a view of qkv's
    other = torch.randn(num_rows, 256, generator=gen).bfloat16()
    full = num_rows // 32 * 32
    whole = cpu_kernels.cpu_linear_amx(x, weight, None, "add", other)
    head = cpu_kernels.cpu_linear_amx(x[:full], weight, None, "add", other[:full])
    tail = cpu_kernels.cpu_linear_amx(x[full:], weight, None, "add", other[full:])
    torch.testing.assert_close(whole, torch.cat([head, tail]), atol=0, rtol=0)
