"""One-shot check for a machine with a GPU (``make gpu-check``), under five minutes:

1. the kernel tests (tests/unit/test_kernels.py) on CUDA tensors, compiled;
2. the engine on CUDA generates HF ``generate``'s greedy tokens (float32), with attention as model_runner wires it
   (every attention op on the kernels: KV write, decode, prefill) and the KV pool sized from gpu_memory_utilization
   after a profiling forward, and again with a token budget of 16 (chunked prefill mixed with decodes);
3. the decode kernel's achieved bandwidth (K/V, Q, block tables read, output written) beside the device's measured
   copy bandwidth and beside the torch reference on the same inputs;
4. engine tokens/s at batch 1, 32, 128 and 256 beside HF ``generate`` (bfloat16, same prompts, same lengths), and
   beside the same engine with the torch reference attention.

Results go to a JSON file (written after every section, so a timeout keeps what finished) whose path is printed.
``--dry-run`` runs every section on the CPU with ``TRITON_INTERPRET=1``, a tiny random Llama and tiny sizes: the
figures mean nothing, but every line of the script runs (tests/unit/test_gpu_check.py calls it).

    python -m bench.gpu_check [--model models/smollm2-135m-instruct] [--out reports/gpu_check.json]
"""

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from backend.contract.settings import DEFAULT_MODEL

REPO_ROOT = Path(__file__).resolve().parents[1]
E2E_PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "Paris is the capital of",
]
BANDWIDTH_TARGET = 0.70  # of measured copy bandwidth, at large batch x context


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before backend.kernels decorates its kernels
    import torch
    import triton

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (use --dry-run to exercise the script on a CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    out_path = Path(args.out).absolute()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    deadline = time.monotonic() + args.time_budget_s
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if not args.dry_run else tiny_model(Path(tmp), Path(args.model))
        sections = [
            ("kernel_tests", lambda: kernel_tests(args.dry_run)),
            ("engine_vs_hf", lambda: engine_vs_hf(model, device, args.dry_run)),
            ("decode_bandwidth", lambda: decode_bandwidth(device, args.dry_run)),
            ("throughput", lambda: throughput(model, device, args.dry_run, deadline)),
        ]
        for name, run in sections:
            started = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                results[name] = run()
            except Exception as exc:  # report and go on: one broken section must not hide the others
                traceback.print_exc()
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            results[name]["seconds"] = round(time.perf_counter() - started, 1)
            out_path.write_text(json.dumps(results, indent=2) + "\n")
            free_device_memory()
    results["passed"] = passed(results)
    out_path.write_text(json.dumps(results, indent=2) + "\n")
    print_summary(results)
    print(f"results written to {out_path}")
    return 0 if results["passed"] else 1


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO_ROOT / DEFAULT_MODEL),
                        help="HF folder (with --dry-run: only its tokenizer is used)")
    parser.add_argument("--out", default=str(REPO_ROOT / "reports" / "gpu_check.json"))
    parser.add_argument("--time-budget-s", type=float, default=280.0,
                        help="throughput points that would start past this are skipped")
    parser.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny sizes")
    return parser.parse_args(argv)


def passed(results: dict) -> bool:
    if any("error" in section for section in results.values() if isinstance(section, dict)):
        return False
    fp32 = results["engine_vs_hf"]["float32"]
    on_kernels = results["dry_run"] or all(v["attention"] == "triton" for v in fp32.values())
    return results["kernel_tests"]["returncode"] == 0 and on_kernels and all(v["greedy_match"] for v in fp32.values())


# ---- 1. kernel tests ----------------------------------------------------------------------------------------------


def kernel_tests(dry_run: bool) -> dict:
    env = dict(os.environ)
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
        select = ["-k", "write_kv_matches_reference and fp32"]
    else:
        env.pop("TRITON_INTERPRET", None)
        select = []
    cmd = [sys.executable, "-m", "pytest", "tests/unit/test_kernels.py", "-q", "-p", "no:cacheprovider", *select]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(proc.stdout[-3000:] if proc.returncode else summary, flush=True)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|skipped)", summary)}
    return {"returncode": proc.returncode, "summary": summary, **counts}


# ---- 2. engine vs HF ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def attention_backend(engine, backend):
    """Run the engine's attention on ``backend`` through the model's hook (the runner builds its metadata)."""
    model = engine.runner.model
    saved, model.attention = model.attention, backend
    try:
        yield
    finally:
        model.attention = saved


def engine_vs_hf(model: Path, device, dry_run: bool) -> dict:
    """Greedy tokens of the engine equal HF's (float32), up to HF's EOS (the engine is told to ignore EOS).

    "as_wired" runs attention as model_runner chooses it for the device (on CUDA: the kernels for every op) with the
    KV pool sized by profiling; "all_kernels" puts every attention op on the kernels through the same hook and uses a
    token budget of 16, so prompts are prefilled in chunks over a cached prefix, mixed with decodes.
    bfloat16 is reported (matching prefix), not judged: two correct bf16 implementations may part ways.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from backend.engine.attention.triton_backend import TritonAttention
    from backend.engine.sampling_params import SamplingParams
    from backend.engine.tokenizer import load_tokenizer
    from bench.engines import build_engine

    new_tokens = 6 if dry_run else 32
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    report = {}
    for dtype in ("float32", "bfloat16"):
        base = dict(device=device.type, dtype=dtype, block_size=16, max_model_len=512, max_num_seqs=8)
        kv = dict(num_kv_blocks=64) if dry_run else dict(gpu_memory_utilization=0.3)  # sizing from free memory
        variants = {"as_wired": dict(max_num_batched_tokens=2048), "all_kernels": dict(max_num_batched_tokens=16)}
        engine = None
        ours = {}
        for name, overrides in variants.items():
            engine = build_engine(model, **base, **kv, **overrides)
            backend = TritonAttention() if name == "all_kernels" else engine.runner.model.attention
            with attention_backend(engine, backend):
                ours[name] = [c.token_ids for c in engine.generate(E2E_PROMPTS, params)]
            report.setdefault(dtype, {})[name] = {
                "attention": backend.name,
                "kv_blocks": engine.runner.num_kv_blocks,
                "kv_cache_gib": round(engine.runner.kv_cache_bytes / 2**30, 2),
            }
            del engine
            free_device_memory()
        hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype)).to(device).eval()
        tokenizer = load_tokenizer(str(model))
        theirs = []
        for prompt in E2E_PROMPTS:
            input_ids = torch.tensor([tokenizer.encode(prompt)], device=device)
            with torch.inference_mode():
                out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=tokenizer.hf.pad_token_id)
            theirs.append(out[0, input_ids.shape[1]:].tolist())
        del hf
        for name, generated in ours.items():
            prefixes = [common_prefix(a, b) for a, b in zip(generated, theirs)]
            report[dtype][name].update(
                greedy_match=all(p == len(b) for p, b in zip(prefixes, theirs)),
                matching_prefix=prefixes,
                hf_lengths=[len(b) for b in theirs],
            )
    return report


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- 3. decode bandwidth ------------------------------------------------------------------------------------------


def decode_bandwidth(device, dry_run: bool) -> dict:
    """Decode kernel bandwidth on scattered block tables, beside the copy bandwidth and the torch reference."""
    copy_gbs = copy_bandwidth(device, (64 << 20) if dry_run else (4 << 30))
    # (name, batch, context, query heads, KV heads, head_dim, block_size), bfloat16
    shapes = [("tiny", 2, 80, 6, 2, 64, 16)] if dry_run else [
        ("llama8b-like b256 ctx4096 bs16", 256, 4096, 32, 8, 128, 16),
        ("llama8b-like b256 ctx4096 bs32", 256, 4096, 32, 8, 128, 32),
        ("smollm2 b256 ctx2048", 256, 2048, 9, 3, 64, 16),
        ("llama8b-like b8 ctx8192 (split)", 8, 8192, 32, 8, 128, 16),
        ("llama8b-like b1 ctx32768 (split)", 1, 32768, 32, 8, 128, 16),
    ]
    rows = []
    for shape in shapes:
        row = measure_decode(*shape, device=device)
        row["fraction_of_copy"] = round(row["kernel_gbs"] / copy_gbs, 3)
        rows.append(row)
        free_device_memory()
    large = [r for r in rows if r["shape"].startswith(("llama8b-like b256", "smollm2 b256"))]
    return {
        "copy_gbs": round(copy_gbs, 1),
        "rows": rows,
        "target_fraction": BANDWIDTH_TARGET,
        "meets_target": bool(large) and min(r["fraction_of_copy"] for r in large) >= BANDWIDTH_TARGET,
    }


def copy_bandwidth(device, num_bytes: int) -> float:
    """GB/s of a device-to-device tensor copy, counting bytes read plus bytes written (as STREAM's copy does)."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / timed(functools.partial(dst.copy_, src), device) / 1e9


def measure_decode(name, batch, context, num_heads, num_kv_heads, head_dim, block_size, device) -> dict:
    import torch

    from backend.engine.attention.torch_backend import paged_decode_attention
    from backend.kernels import cuda_decode_attention

    num_blocks = batch * context // block_size
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, context // block_size)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_heads, head_dim, dtype=torch.bfloat16, device=device)
    inputs = (query, k_cache, v_cache, tables, lens, head_dim**-0.5)
    out = cuda_decode_attention(*inputs)
    seconds = timed(functools.partial(cuda_decode_attention, *inputs), device)
    kv_bytes = 2 * k_cache.numel() * k_cache.element_size()
    moved = kv_bytes + 2 * query.numel() * query.element_size() + tables.numel() * 4  # K, V, Q, output, tables
    row = {
        "shape": name, "kv_mib": round(kv_bytes / 2**20), "kernel_us": round(seconds * 1e6, 1),
        "kernel_gbs": round(moved / seconds / 1e9, 1),
    }
    try:  # the reference gathers a copy of every context: it may not fit where the kernel does
        ref = paged_decode_attention(*inputs)
        row["max_abs_err_vs_reference"] = float((out.float() - ref.float()).abs().max())
        del ref
        ref_s = timed(functools.partial(paged_decode_attention, *inputs), device)
        row.update(reference_us=round(ref_s * 1e6, 1), reference_gbs=round(moved / ref_s / 1e9, 1))
    except torch.OutOfMemoryError:
        row["reference_us"] = "out of memory"
    return row


def timed(fn, device) -> float:
    """Median seconds per call: triton's do_bench (L2 flushed between calls) on CUDA, perf_counter on the CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# ---- 4. throughput ------------------------------------------------------------------------------------------------


def throughput(model: Path, device, dry_run: bool, deadline: float) -> dict:
    """Generated tokens/s (prompt processing included) of the engine and of HF generate, same prompts and lengths."""
    import torch
    from transformers import AutoModelForCausalLM

    from backend.engine.attention import TorchAttention
    from backend.engine.attention.triton_backend import TritonAttention
    from backend.engine.sampling_params import SamplingParams
    from bench.engines import blocks_for, build_engine

    batches = [1, 2] if dry_run else [1, 32, 128, 256]
    prompt_len, new_tokens = (8, 4) if dry_run else (64, 128)
    dtype = "float32" if dry_run else "bfloat16"
    engine = build_engine(
        model, device=device.type, dtype=dtype, block_size=16, max_num_seqs=max(batches),
        max_num_batched_tokens=8192, max_model_len=prompt_len + new_tokens + 16,
        num_kv_blocks=max(batches) * blocks_for(prompt_len + new_tokens) + 8,
    )
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype)).to(device).eval()
    vocab = engine.runner.shape.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def run_engine(prompts):
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        sync(device)
        return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)

    def run_hf(prompts):
        input_ids = torch.tensor(prompts, device=device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        sync(device)
        return (out.shape[1] - prompt_len) * out.shape[0] / (time.perf_counter() - start)

    # The engine as wired, beside the same engine with the other attention through the same hook: on CUDA the torch
    # reference (what the kernels gain), on a CPU dry run the kernels (interpreted: only that they run).
    other_key, other = (
        ("engine_torch_attention_tok_s", TorchAttention()) if device.type == "cuda"
        else ("engine_all_kernels_tok_s", TritonAttention())
    )
    warmup = [[1] * prompt_len, [2] * (prompt_len // 2)]  # compiles the kernels before anything is timed
    engine.generate(warmup, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    with attention_backend(engine, other):
        engine.generate(warmup, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    rows = []
    for batch in batches:
        if time.monotonic() > deadline:
            rows.append({"batch": batch, "skipped": "time budget spent"})
            continue
        prompts = torch.randint(1, vocab, (batch, prompt_len), generator=gen).tolist()
        row = {"batch": batch, "engine_tok_s": round(run_engine(prompts), 1)}
        with attention_backend(engine, other):
            row[other_key] = round(run_engine(prompts), 1)
        row["hf_generate_tok_s"] = round(run_hf(prompts), 1)
        row["engine_vs_hf"] = round(row["engine_tok_s"] / row["hf_generate_tok_s"], 2)
        rows.append(row)
        print(row, flush=True)
    return {
        "dtype": dtype, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "attention": engine.runner.model.attention.name, "compared_with": other.name, "rows": rows,
    }


# ---- helpers ------------------------------------------------------------------------------------------------------


def tiny_model(tmp: Path, tokenizer_dir: Path) -> Path:
    from tests.server_harness import make_tiny_llama

    return make_tiny_llama(tmp / "tiny-llama", tokenizer_dir)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def print_summary(results: dict) -> None:
    print(f"\ngpu-check on {results['device']} (torch {results['torch']}, triton {results['triton']})")
    k = results["kernel_tests"]
    print(f"kernel tests: {k.get('summary') or k.get('error')}")
    for dtype, variants in results["engine_vs_hf"].items():
        if dtype in ("seconds", "error"):
            continue
        for name, v in variants.items():
            print(f"engine vs HF {dtype:8s} {name:11s} ({v['attention']} attention): greedy match {v['greedy_match']} "
                  f"(matching prefix {v['matching_prefix']} of {v['hf_lengths']}), KV blocks {v['kv_blocks']} "
                  f"({v['kv_cache_gib']} GiB)")
    bw = results["decode_bandwidth"]
    if "rows" in bw:
        print(f"copy bandwidth {bw['copy_gbs']} GB/s; target: decode >= {bw['target_fraction']:.0%} at large batch")
        header = ("decode shape", "KV MiB", "kernel us", "GB/s", "of copy", "torch ref GB/s")
        print("{:34s} {:>7s} {:>10s} {:>7s} {:>8s} {:>15s}".format(*header))
        for r in bw["rows"]:
            print(f"{r['shape']:34s} {r['kv_mib']:7d} {r['kernel_us']:10.1f} {r['kernel_gbs']:7.1f} "
                  f"{r['fraction_of_copy']:8.1%} {str(r.get('reference_gbs', r.get('reference_us'))):>15s}")
    tp = results["throughput"]
    if "rows" in tp:
        print(f"tokens/s, {tp['dtype']}, prompt {tp['prompt_len']}, {tp['new_tokens']} new tokens (prefill included)")
        engine_col, other_col = f"engine ({tp['attention']})", f"engine ({tp['compared_with']})"
        print(f"{'batch':>5s} {engine_col:>20s} {other_col:>20s} {'HF generate':>12s} {'engine/HF':>10s}")
        for r in tp["rows"]:
            if "skipped" in r:
                print(f"{r['batch']:5d} skipped: {r['skipped']}")
                continue
            other = r.get("engine_torch_attention_tok_s", r.get("engine_all_kernels_tok_s"))
            print(f"{r['batch']:5d} {r['engine_tok_s']:20.1f} {other:20.1f} "
                  f"{r['hf_generate_tok_s']:12.1f} {r['engine_vs_hf']:10.2f}")
    print(f"passed: {results['passed']}")


if __name__ == "__main__":
    sys.exit(main())
