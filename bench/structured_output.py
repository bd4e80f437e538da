"""What structured output costs a decode step: the step at batch 1 and 8 with every row held to a grammar, beside
the same step unconstrained, in one run.

    flock /tmp/llm-bench.lock python -m bench.structured_output --model models/smollm2-135m-instruct \\
        [--batches 1,8] [--repeats 3] [--out reports/bench_structured_output.json]

The run's record (``records/``) goes beside the JSON (``bench_structured_output.record.json``), table ``steps``.

One engine; at each batch the three ways take turns (their order rotated each repeat), each keeping its best median
decode step at the full batch (``bench.engines.timed_generate``), so all see the same background load. The ways:
``none`` (unconstrained), ``regex`` (free text, ``[a-z ,.]{1,4000}``: a mask over most of the vocabulary at every
step) and ``json`` (a JSON schema: an object holding a list of records, whose mask changes with the JSON's state). The
prompts are chat turns asking for what each grammar holds. The mask's share of the step is the step's time beside
``none``'s; the ``mask ms`` column is the median time of the sampling phase (mask and sampler) beside ``none``'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

from backend.contract.settings import DEFAULT_MODEL  # noqa: E402
from backend.engine.sampling_params import SamplingParams  # noqa: E402
from bench.engines import fixed_batch_engine, median_ms, timed_generate  # noqa: E402
from records.record import Column, Record  # noqa: E402

SCHEMA = {
    "type": "object", "required": ["items"], "additionalProperties": False,
    "properties": {"items": {"type": "array", "items": {
        "type": "object", "required": ["name", "quantity"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 24}, "quantity": {"type": "integer"}}}}},
}
WAYS = {
    "none": (None, "Write a long story about a lighthouse keeper."),
    "regex": ({"regex": "[a-z ,.]{1,4000}"}, "Write a long story about a lighthouse keeper, in lower case."),
    "json": ({"json": SCHEMA}, "List every item a grocery store sells, with a quantity, as JSON."),
}


def run(args) -> dict:
    engine = fixed_batch_engine(args.model, None, max(args.batches), args.prompt_len, args.new_tokens,
                                num_threads=args.threads)
    hf = engine.tokenizer.hf
    prompts = {way: list(hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"])
               for way, (_, text) in WAYS.items()}
    steps: dict[str, dict[int, float]] = {way: {} for way in WAYS}
    sampling: dict[str, dict[int, float]] = {way: {} for way in WAYS}
    for batch in args.batches:
        for repeat in range(args.repeats):
            order = list(WAYS)[repeat % len(WAYS):] + list(WAYS)[:repeat % len(WAYS)]
            for way in order:
                spec = WAYS[way][0]
                params = [SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=i, ignore_eos=True,
                                         structured_outputs=spec) for i in range(batch)]
                _, records = timed_generate(engine, [prompts[way]] * batch, params, batch)
                step, sample = median_ms(records), median_ms(records, "sample")
                if step == step and step < steps[way].get(batch, float("inf")):  # NaN: no step at the full batch
                    steps[way][batch], sampling[way][batch] = step, sample
    return {"decode_step_ms": steps, "sample_ms": sampling, "batches": args.batches}


def record_table(record: Record, result: dict) -> Record:
    """The table ``steps``: a row per way and batch, the step beside the unconstrained one from the same run."""
    columns = [Column("way", "grammar"), Column("batch"), Column("step_ms", "step ms", "{:.2f}"),
               Column("vs_none", "x none", "{:.3f}x"), Column("sample_ms", "mask + sample ms", "{:.2f}"),
               Column("none_sample_ms", "none's sample ms", "{:.2f}")]
    steps, sampling = result["decode_step_ms"], result["sample_ms"]
    rows = []
    for way in WAYS:
        for batch in result["batches"]:
            if batch not in steps[way] or batch not in steps["none"]:
                continue
            rows.append({"way": way, "batch": batch, "step_ms": steps[way][batch],
                         "vs_none": steps[way][batch] / steps["none"][batch], "sample_ms": sampling[way][batch],
                         "none_sample_ms": sampling["none"][batch]})
    record.add_table("steps", columns, rows)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")], default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=64, help="room in the KV pool for prompts this long")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("reports/bench_structured_output.json"))
    args = parser.parse_args(argv)
    record = Record.start("python -m bench.structured_output", vars(args))
    result = run(args)
    print(record_table(record, result).tables["steps"].markdown())
    record.write_beside(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
