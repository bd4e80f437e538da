"""How every benchmark builds an engine on one weight format, and what they time with it: random prompts, one timed
``generate`` and its decode steps, the median of a phase over steps, the bytes of the weights as held.

A weight format is a :class:`WeightFormat` or its name (``bf16``, ``q4_1``, ``int8``; ``None``: the checkpoint's own
weights in ``dtype``), turned here into the engine's ``quantization`` (``None`` for bf16). The entry points call
``backend.engine.openmp.set_wait_policy()`` before they import this module, which loads torch.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from backend.contract.settings import DEFAULT_MODEL
from backend.engine.config import WEIGHT_FORMATS, EngineConfig
from backend.engine.linear import Linear
from backend.engine.llm_engine import LLMEngine
from backend.engine.sampling_params import SamplingParams
from backend.engine.stats import StepRecord
from backend.kernels.weight_format import WeightFormat


def weight_formats_parser(description: str) -> argparse.ArgumentParser:
    """The command line of a benchmark across weight formats: ``--model`` and ``--formats`` (comma-separated names,
    read by :func:`parse_formats`), ``--threads``; the benchmark adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--formats", default=",".join(WEIGHT_FORMATS), help="comma-separated (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    return parser


def parse_formats(parser: argparse.ArgumentParser, formats: str) -> list[WeightFormat]:
    """``--formats`` as weight formats; a name that is none exits through ``parser.error``."""
    try:
        return [WeightFormat.parse(name, WEIGHT_FORMATS, "--formats") for name in formats.split(",")]
    except ValueError as exc:
        parser.error(str(exc))


def engine_config(model: str, weight_format: WeightFormat | str | None = None, **settings) -> EngineConfig:
    """``EngineConfig`` of ``model`` on ``weight_format`` with the other ``settings`` (its fields) as given."""
    fmt = WeightFormat(weight_format or WeightFormat.BF16)
    return EngineConfig(model=str(model), quantization=fmt if fmt.quantized else None, **settings)


def build_engine(model: str, weight_format: WeightFormat | str | None = None, **settings) -> LLMEngine:
    """An engine of ``model`` on ``weight_format`` (see :func:`engine_config`)."""
    return LLMEngine(engine_config(model, weight_format, **settings))


def blocks_for(num_tokens: int, block_size: int = 16) -> int:
    """KV blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def fixed_batch_engine(model: str, weight_format: WeightFormat | str | None, batch: int, prompt_len: int,
                       new_tokens: int, **settings) -> LLMEngine:
    """An engine for ``batch`` prompts of ``prompt_len`` tokens generating ``new_tokens`` each, all at once (room
    for the whole batch in one prefill step and in the KV pool), warmed up (:func:`warm_up`)."""
    engine = build_engine(
        model, weight_format, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * prompt_len),
        max_model_len=prompt_len + new_tokens + 16, num_kv_blocks=batch * blocks_for(prompt_len + new_tokens) + 16,
        **settings,
    )
    warm_up(engine, prompt_len, settings.get("seed", 0))
    return engine


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(length)] for _ in range(num)]


def warm_up(engine: LLMEngine, prompt_len: int, seed: int = 0) -> None:
    """Two short greedy requests: the first calls at a new shape pay one-off costs."""
    prompts = random_prompts(2, prompt_len, engine.runner.shape.vocab_size, seed + 99)
    engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))


def timed_generate(engine: LLMEngine, prompts: list[list[int]], params, batch: int) -> tuple[float, list[StepRecord]]:
    """Output tok/s of one ``generate`` (prefill included) and its decode steps at the full batch."""
    first_step = engine.stats.num_steps
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    steps = engine.stats.recent_steps()[-(engine.stats.num_steps - first_step):]
    decode_steps = [r for r in steps if r.num_tokens == r.num_seqs == batch]
    return sum(len(o.token_ids) for o in outputs) / elapsed, decode_steps


def median_ms(steps: list[StepRecord], phase: str = "total") -> float:
    """Median time of ``phase`` (a field of the steps' timings) over ``steps``, in ms; NaN without steps."""
    return statistics.median(getattr(r.times, phase) for r in steps) * 1e3 if steps else float("nan")


def held_weight_bytes(engine: LLMEngine) -> int:
    """Bytes of every weight the engine's forward reads (projections as held, norms, a separate embedding)."""
    model = engine.runner.model
    held = [model.lm_head, model.final_norm, model._embed]
    for layer in model.layers:
        held += [layer.input_norm, layer.post_norm, layer.qkv, layer.o, layer.gate, layer.up, layer.down]
    tensors = [t for item in held for t in ((item.weight, item.bias) if isinstance(item, Linear) else (item,))]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
