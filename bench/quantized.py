"""Quantized weights beside bf16, in one run: the decode step per format and batch, the weights' memory and the KV
blocks it frees, and greedy agreement with bf16.

    flock /tmp/llm-bench.lock python -m bench.quantized --model models/smollm2-135m-instruct \\
        [--formats bf16,q4_1,int8] [--batches 1,8,32,64] [--repeats 3] [--out reports/bench_quantized.json]

The run's record (``records/``) goes beside the JSON (``bench_quantized.record.json``), table ``formats``.

One engine per format, all loaded in this process; at each batch size the formats take turns (their order rotated
each repeat), and each keeps its best median decode step of ``--repeats`` runs, so all see the same background load
on a shared machine. The decode step is the median of a ``generate``'s steps at the full batch (random prompts of
``--prompt-len`` token ids, ``ignore_eos``). Greedy agreement: each format's greedy tokens on a few chat prompts
against bf16's, as the share of tokens equal up to the first difference (one different token changes every later
one, so after it the texts are compared by eye, not counted).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import torch  # noqa: E402

from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.engine.sampling_params import SamplingParams  # noqa: E402
from backend.kernels.weight_format import WeightFormat  # noqa: E402
from bench.engines import (  # noqa: E402
    fixed_batch_engine,
    held_weight_bytes,
    median_ms,
    parse_formats,
    random_prompts,
    timed_generate,
    weight_formats_parser,
)
from records.record import Column, Record  # noqa: E402

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paper clip.",
    "What is 12 times 7?",
    "Who wrote Pride and Prejudice?",
)


BF16 = WeightFormat.BF16  # the baseline every format is measured against


def greedy_agreement(engines: dict[WeightFormat, LLMEngine], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    hf_tokenizer = engines[BF16].tokenizer.hf
    prompts = [hf_tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True) for p in PROMPTS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    outputs = {fmt: engine.generate(prompts, params) for fmt, engine in engines.items()}
    result = {}
    for fmt, outs in outputs.items():
        same = total = 0
        for out, ref in zip(outs, outputs[BF16]):
            prefix = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref.token_ids)) if a != b),
                          min(len(out.token_ids), len(ref.token_ids)))
            same, total = same + prefix, total + len(ref.token_ids)
        result[fmt] = {"prefix_share": same / total, "texts": [o.text for o in outs]}
    return result


def run(args: argparse.Namespace, log=print) -> dict:
    formats, batches = args.formats, args.batches
    engines = {fmt: fixed_batch_engine(args.model, fmt, max(batches), args.prompt_len, args.new_tokens,
                                       num_threads=args.threads) for fmt in formats}
    bf16 = engines[BF16]
    block_bytes = bf16.config.block_bytes
    memory = {fmt: {"weight_mib": held_weight_bytes(e) / 2**20,
                    "kv_blocks_gained": (held_weight_bytes(bf16) - held_weight_bytes(e)) // block_bytes}
              for fmt, e in engines.items()}
    vocab = bf16.runner.shape.vocab_size
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    steps: dict[WeightFormat, dict[int, float]] = {fmt: {} for fmt in formats}
    for batch in batches:
        prompts = random_prompts(batch, args.prompt_len, vocab, batch)
        for repeat in range(args.repeats):
            for fmt in formats[repeat % len(formats):] + formats[: repeat % len(formats)]:
                _, records = timed_generate(engines[fmt], prompts, params, batch)
                step = median_ms(records)
                steps[fmt][batch] = min(steps[fmt].get(batch, float("inf")), step)
        log(f"B={batch}: " + ", ".join(f"{fmt} {steps[fmt][batch]:.2f} ms" for fmt in formats))
    agreement = greedy_agreement(engines, args.agreement_tokens)
    return {
        "config": {"model": args.model, "threads": args.threads, "prompt_len": args.prompt_len,
                   "new_tokens": args.new_tokens, "repeats": args.repeats, "torch": torch.__version__,
                   "block_bytes": block_bytes},
        "decode_step_ms": {fmt: {str(b): ms for b, ms in by_batch.items()} for fmt, by_batch in steps.items()},
        "memory": memory,
        "greedy_agreement": agreement,
    }


def record_table(record: Record, result: dict) -> Record:
    """The table ``formats``: a row per format, its step at each batch beside bf16's from the same run."""
    steps, batches = result["decode_step_ms"], list(result["decode_step_ms"][BF16])
    columns = [Column("format")]
    for b in batches:
        columns += [Column(f"step_ms_b{b}", f"B={b} step ms", "{:.2f}"),
                    Column(f"ratio_b{b}", f"B={b} x bf16", "{:.2f}x")]
    columns += [Column("weight_mib", "weights MiB", "{:.1f}"), Column("kv_blocks_gained", "KV blocks gained"),
                Column("prefix_share", "greedy prefix = bf16", "{:.0%}")]
    rows = []
    for fmt, by_batch in steps.items():
        row = {"format": fmt, "weight_mib": result["memory"][fmt]["weight_mib"],
               "kv_blocks_gained": result["memory"][fmt]["kv_blocks_gained"],
               "prefix_share": result["greedy_agreement"][fmt]["prefix_share"]}
        for b in batches:
            row[f"step_ms_b{b}"], row[f"ratio_b{b}"] = by_batch[b], by_batch[b] / steps[BF16][b]
        rows.append(row)
    record.add_table("formats", columns, rows)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = weight_formats_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")], default=[1, 8, 32, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--agreement-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("reports/bench_quantized.json"))
    args = parser.parse_args(argv)
    args.formats = parse_formats(parser, args.formats)
    if BF16 not in args.formats:
        args.formats = [BF16, *args.formats]  # the baseline
    record = Record.start("python -m bench.quantized", vars(args))
    result = run(args)
    print(record_table(record, result).tables["formats"].markdown())
    print(f"(KV blocks gained: the blocks of {result['config']['block_bytes']:,} bytes that the weights' saving "
          "against bf16 would hold at the same memory)")
    for fmt, entry in result["greedy_agreement"].items():
        print(f"\n[{fmt}] " + " | ".join(text.replace("\n", " ")[:80] for text in entry["texts"]))
    record.write_beside(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
