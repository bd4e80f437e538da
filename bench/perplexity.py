"""Perplexity of each weight format on a fixed text, beside HF transformers in float32 on the same checkpoint.

    python -m bench.perplexity --model models/smollm2-135m-instruct [--formats bf16,q4_1,int8]
        [--ctx 512] [--text tests/data/perplexity_text.txt] [--out reports/perplexity.json]
        [--llamacpp .llamacpp/bin/llama-perplexity --gguf bf16=.llamacpp/...-bf16.gguf,q4_1=...-q4_1.gguf]

The text (``tests/data/perplexity_text.txt``, 2,880 tokens with SmolLM2's tokenizer) is three public-domain
American documents: the Declaration of Independence, the Gettysburg Address and Lincoln's second inaugural address.
It is scored as llama.cpp's ``llama-perplexity`` scores a file, so the figures can stand beside its own: the tokens
cut into chunks of ``--ctx`` (the remainder dropped), each chunk run alone from an empty cache, and only the second
half of each chunk's positions scored (each of those predicted with at least ``ctx / 2`` tokens before it);
perplexity is exp of the mean negative log-likelihood of the scored tokens. The engine runs each chunk as one
prefill through its own forward (``LlamaModel.forward`` asked for the logits of every position).

With ``--llamacpp``, llama.cpp's own ``llama-perplexity`` scores the same text with the same ``-c`` and threads on
each format's GGUF (``--gguf``: format=path; ``make llamacpp`` builds both), so each format's figure stands beside
llama.cpp's from the same run. The run's record (``records/``) goes beside ``--out`` (``<out>.record.json``), table
``perplexity``.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import torch  # noqa: E402

from backend.engine.model_runner import ModelRunner  # noqa: E402
from backend.engine.request import Request  # noqa: E402
from backend.engine.scheduler import ScheduledRequest  # noqa: E402
from backend.engine.tokenizer import load_tokenizer  # noqa: E402
from backend.kernels.weight_format import WeightFormat  # noqa: E402
from bench.engines import blocks_for, engine_config, parse_formats, weight_formats_parser  # noqa: E402
from records.record import Column, Record  # noqa: E402

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "perplexity_text.txt"


def chunks(token_ids: list[int], ctx: int) -> list[list[int]]:
    if len(token_ids) < 2 * ctx:
        raise ValueError(f"the text has {len(token_ids)} tokens; llama-perplexity's scoring needs at least 2 * ctx")
    return [token_ids[i : i + ctx] for i in range(0, len(token_ids) - ctx + 1, ctx)]


def _nll(logits: torch.Tensor, chunk: list[int]) -> tuple[float, int]:  # logits (ctx, V)
    """Sum of negative log-likelihoods of the second half's tokens, and how many."""
    first = len(chunk) // 2
    log_probs = torch.log_softmax(logits[first - 1 : -1].float(), dim=-1)  # position p predicts token p + 1
    targets = torch.tensor(chunk[first:])
    return -log_probs.gather(1, targets[:, None]).sum().item(), len(targets)


def engine_nll(model: str, weight_format: WeightFormat | None, parts: list[list[int]], threads: int,
               path: str = "prefill") -> tuple[float, int]:
    """The engine's sum of NLLs over ``parts``. ``path``: ``prefill`` runs each chunk as one prefill (where a
    quantized format widens its weights to bf16); ``decode`` runs the first half as a prefill and then scores the
    second half one decode step at a time, the text's own token fed at each step (teacher forcing): what a served
    stream runs, through the quantized kernels."""
    ctx = len(parts[0])
    config = engine_config(model, weight_format, num_threads=threads, max_num_seqs=1, max_num_batched_tokens=ctx,
                           max_model_len=ctx, num_kv_blocks=blocks_for(ctx) + 1)
    runner = ModelRunner(config.resolve())
    total, count = 0.0, 0
    for i, chunk in enumerate(parts):
        request = Request(f"chunk-{i}", chunk)
        request.block_ids = list(range(blocks_for(ctx, runner.block_size)))
        with torch.inference_mode():
            if path == "prefill":
                logits = _run(runner, ScheduledRequest.of(request, ctx), ctx)  # (ctx, V)
            else:
                first = ctx // 2
                _run(runner, ScheduledRequest(request, first - 1, False), 1)  # positions 0 .. first - 2
                request.num_computed_tokens = first - 1
                rows = []
                for position in range(first - 1, ctx - 1):  # the token at `position` in, the next one scored
                    rows.append(_run(runner, ScheduledRequest(request, 1, True), 1))
                    request.num_computed_tokens = position + 1
                logits = torch.cat([torch.zeros(first - 1, rows[0].shape[-1]), *rows, rows[-1]])  # (ctx, V)
        nll, n = _nll(logits, chunk)
        total, count = total + nll, count + n
    return total, count


def _run(runner: ModelRunner, scheduled: ScheduledRequest, num_logits: int) -> torch.Tensor:
    """One forward of ``scheduled``; the logits of its last ``num_logits`` positions (num_logits, V)."""
    inputs = runner.prepare([scheduled])
    last = torch.arange(scheduled.num_new_tokens - num_logits, scheduled.num_new_tokens)
    return runner.model.forward(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, last).float()


def hf_nll(model: str, parts: list[list[int]]) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for chunk in parts:
        with torch.inference_mode():
            logits = hf(torch.tensor([chunk])).logits[0]
        nll, n = _nll(logits, chunk)
        total, count = total + nll, count + n
    return total, count


# llama-perplexity's last line of results: "Final estimate: PPL = 23.0594 +/- 0.71512"
FINAL_ESTIMATE = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def llamacpp_perplexity(binary: Path, gguf: Path, text: Path, ctx: int, threads: int, timeout_s: float = 900) -> float:
    """llama-perplexity's figure for ``gguf`` on ``text`` (its own chunking and scoring, which :func:`chunks` and
    :func:`_nll` copy)."""
    done = subprocess.run([str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-t", str(threads),
                           "-b", str(ctx)], capture_output=True, text=True, timeout=timeout_s)
    found = FINAL_ESTIMATE.search(done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"{binary} on {gguf} exited {done.returncode} without a final estimate: {tail}")
    return float(found.group(1))


def parse_ggufs(raw: str) -> dict[str, Path]:
    """``bf16=a.gguf,q4_1=b.gguf`` -> {format: path}."""
    ggufs = {}
    for item in filter(None, raw.split(",")):
        name, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--gguf takes format=path pairs, comma-separated; got {item!r}")
        ggufs[name.strip()] = Path(path.strip())
    return ggufs


def record_table(record: Record, ppl: dict[str, float], llamacpp: dict[str, float], path: str) -> Record:
    """The table ``perplexity``: a row per format, beside HF float32 and (where run) llama.cpp's from the same run."""
    columns = [Column("format"), Column("path", "engine path"), Column("engine", "engine perplexity", "{:.3f}"),
               Column("vs_hf", "vs HF float32", "{:+.2%}")]
    if llamacpp:
        columns += [Column("llamacpp", "llama.cpp perplexity", "{:.3f}"),
                    Column("vs_llamacpp", "vs llama.cpp", "{:+.2%}")]
    rows = [{"format": "HF float32", "path": "transformers", "engine": ppl["hf_fp32"], "vs_hf": 0.0}]
    for name, value in ppl.items():
        if name == "hf_fp32":
            continue
        row = {"format": name, "path": path, "engine": value, "vs_hf": value / ppl["hf_fp32"] - 1}
        if name in llamacpp:
            row["llamacpp"], row["vs_llamacpp"] = llamacpp[name], value / llamacpp[name] - 1
        rows.append(row)
    record.add_table("perplexity", columns, rows)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = weight_formats_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--path", choices=("prefill", "decode"), default="prefill",
                        help="score the engine's prefill (default) or its decode steps (the quantized kernels)")
    parser.add_argument("--out", type=Path, default=Path("reports/perplexity.json"))
    parser.add_argument("--llamacpp", type=Path, help="llama.cpp's llama-perplexity (make llamacpp builds it)")
    parser.add_argument("--gguf", default="", help="with --llamacpp: format=path pairs, comma-separated")
    args = parser.parse_args(argv)
    formats = parse_formats(parser, args.formats)
    try:
        ggufs = parse_ggufs(args.gguf)
    except ValueError as exc:
        parser.error(str(exc))
    if args.llamacpp and not ggufs:
        parser.error("--llamacpp needs --gguf format=path (e.g. bf16=.llamacpp/smollm2-135m-instruct-bf16.gguf)")
    record = Record.start("python -m bench.perplexity", vars(args))
    token_ids = load_tokenizer(args.model).encode(args.text.read_text())
    parts = chunks(token_ids, args.ctx)
    results = {"hf_fp32": hf_nll(args.model, parts)}
    for fmt in formats:
        results[fmt] = engine_nll(args.model, fmt, parts, args.threads, args.path)
    ppl = {name: math.exp(total / count) for name, (total, count) in results.items()}
    scored = next(iter(results.values()))[1]
    print(f"perplexity on {args.text.name}: {len(token_ids)} tokens, {len(parts)} chunks of {args.ctx}, "
          f"{scored} scored, the engine's {args.path} path")
    llamacpp = {name: llamacpp_perplexity(args.llamacpp, gguf, args.text, args.ctx, args.threads)
                for name, gguf in ggufs.items()} if args.llamacpp else {}
    print(record_table(record, ppl, llamacpp, args.path).tables["perplexity"].markdown())
    record.write_beside(args.out, {"text": args.text.name, "tokens": len(token_ids), "ctx": args.ctx,
                                   "path": args.path, "scored_tokens": scored, "perplexity": ppl, "llamacpp": llamacpp})
    return 0


if __name__ == "__main__":
    sys.exit(main())
