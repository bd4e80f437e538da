"""A mixed step against its parts: one engine step carrying a prefill chunk and N decodes, beside a step of that
chunk alone and a decode step of the N rows alone (``make bench``'s breakdown; the target is mixed <= 1.1x the
sum of the parts).

Every arm is a real :meth:`LLMEngine.step` (schedule, prepare, forward, sample, update), so the figures are what the
continuous loop pays. N requests are prefilled once and then decode; each prefill arm adds a fresh request of
``chunk`` prompt tokens, steps once and aborts it:

* ``decode``: a step of the N running requests alone;
* ``prefill``: a step of the new request alone (``step(only=...)``: the N others are not stepped);
* ``mixed``: a plain step, which schedules the N decodes and admits the new request's whole prompt beside them.

The arms alternate (their order rotating every round) so that background load on a shared machine hits them alike;
each figure is the median over the rounds.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

from backend.engine.llm_engine import LLMEngine
from backend.engine.sampling_params import SamplingParams
from bench.engines import build_engine

ARMS = ("decode", "prefill", "mixed")
PHASES = ("prepare", "forward", "sample")


def mixed_step_breakdown(
    model: str, dtype: str, threads: int, cases: list[tuple[int, int]], context: int = 256, rounds: int = 5,
    seed: int = 0, log: Callable[[str], None] = print, quantization: str | None = None,
) -> list[dict]:
    """One entry per ``(num_decodes, chunk)`` case: ``num_decodes``, ``chunk``, ``context`` (the decodes' context),
    ``rounds``; ``decode_ms``, ``prefill_ms``, ``mixed_ms`` (median whole step of each arm), ``parts_ms`` (decode +
    prefill) and ``ratio`` (mixed / parts); ``phases``: arm -> phase -> median ms (prepare, forward, sample)."""
    max_decodes = max(n for n, _ in cases)
    max_chunk = max(c for _, c in cases)
    num_steps = (rounds + 1) * len(ARMS) * len(cases)  # every arm's step makes each decoding request one token longer
    engine = build_engine(
        model, quantization, dtype=dtype, num_threads=threads, max_num_seqs=max_decodes + 1,
        max_num_batched_tokens=max(2048, max_decodes * context, max_decodes + max_chunk),
        max_model_len=context + num_steps + max_chunk + 16, seed=seed,
    )
    vocab = engine.runner.shape.vocab_size
    rng = random.Random(seed)
    prompt = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    decode_params = SamplingParams(max_tokens=num_steps + 2, temperature=0.0, ignore_eos=True)
    prefill_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows = []
    for num_decodes, chunk in cases:
        running = [engine.add_request(None, prompt(context), decode_params) for _ in range(num_decodes)]
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in running):
            engine.step()  # prefill them: from here on each step is one decode per request

        for arm in ARMS:  # warm-up: first calls at a new shape pay one-off costs
            _step(engine, arm, num_decodes, chunk, prompt, prefill_params)
        times: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
        for i in range(rounds):
            for arm in ARMS[i % len(ARMS):] + ARMS[: i % len(ARMS)]:
                times[arm].append(_step(engine, arm, num_decodes, chunk, prompt, prefill_params))
        for r in running:
            engine.abort(r.request_id)
        median = {arm: {phase: statistics.median(t[phase] for t in times[arm]) * 1e3 for phase in ("total", *PHASES)}
                  for arm in ARMS}
        parts = median["decode"]["total"] + median["prefill"]["total"]
        row = {
            "num_decodes": num_decodes, "chunk": chunk, "context": context, "rounds": rounds,
            "decode_ms": median["decode"]["total"], "prefill_ms": median["prefill"]["total"],
            "mixed_ms": median["mixed"]["total"], "parts_ms": parts, "ratio": median["mixed"]["total"] / parts,
            "phases": {arm: {phase: median[arm][phase] for phase in PHASES} for arm in ARMS},
        }
        log(f"      {num_decodes} decodes + a {chunk}-token chunk: mixed {row['mixed_ms']:.1f} ms, parts "
            f"{row['decode_ms']:.1f} + {row['prefill_ms']:.1f} ms = {row['ratio']:.2f}x")
        rows.append(row)
    return rows


def _step(engine: LLMEngine, arm: str, num_decodes: int, chunk: int, prompt: Callable[[int], list[int]],
          params: SamplingParams) -> dict[str, float]:
    """One step of ``arm`` with the N decoding requests running; its phases in seconds."""
    new = None if arm == "decode" else engine.add_request(None, prompt(chunk), params)
    before = engine.stats.num_steps
    engine.step(only={new.request_id} if arm == "prefill" else None)
    record = engine.stats.recent_steps()[-1]
    expected = {"decode": (num_decodes, num_decodes), "prefill": (1, chunk),
                "mixed": (num_decodes + 1, num_decodes + chunk)}[arm]
    if engine.stats.num_steps != before + 1 or (record.num_seqs, record.num_tokens) != expected:
        raise RuntimeError(f"the {arm} arm ran {record.num_seqs} sequences and {record.num_tokens} tokens, not "
                           f"{expected}: it no longer measures what it says")
    if new is not None:
        engine.abort(new.request_id)  # None: it sampled its one token and finished already
    t = record.times
    return {"total": t.total, "prepare": t.schedule + t.prepare, "forward": t.forward, "sample": t.sample + t.update}


def format_breakdown(rows: list[dict]) -> list[str]:
    """The breakdown as table lines (``make bench``'s section)."""
    lines = [
        f"   {'decodes':>7}  {'chunk':>5}  {'decode step ms':>14}  {'prefill step ms':>15}  {'sum of parts':>12}  "
        f"{'mixed step ms':>13}  {'mixed / parts':>13}  {'forward ms: decode + prefill -> mixed':>38}",
    ]
    for r in rows:
        p = r["phases"]
        forward = (f"{p['decode']['forward']:.1f} + {p['prefill']['forward']:.1f} -> "
                   f"{p['mixed']['forward']:.1f}")
        lines.append(
            f"   {r['num_decodes']:>7}  {r['chunk']:>5}  {r['decode_ms']:>14.1f}  {r['prefill_ms']:>15.1f}  "
            f"{r['parts_ms']:>12.1f}  {r['mixed_ms']:>13.1f}  {r['ratio']:>12.2f}x  {forward:>38}"
        )
    return lines
