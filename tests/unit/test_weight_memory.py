"""One copy of each weight: the layout the C kernels share read back exactly, the file of prepared weights built once
and mapped read-only, and an engine's resident and proportional memory within weights + KV pool + 400 MiB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backend.engine import weight_file
from backend.engine.config import EngineConfig
from backend.engine.linear import Layout, Linear, c_layout
from backend.engine.model import LlamaModel
from backend.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
OVERHEAD_MIB = 400  # an engine's own memory beyond its weights and KV pool: Python, torch, the tokenizer

needs_c = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the torch path is used")


@needs_c
@pytest.mark.parametrize("shape", [(960, 576), (64, 1536), (32, 32)])
def test_the_shared_layout_reads_back_rows_and_the_whole_weight_exactly(shape):
    gen = torch.Generator().manual_seed(shape[0])
    weight = torch.randn(shape, generator=gen).bfloat16()
    prepared = cpu_kernels.prepare_linear_weight(weight)
    rows = torch.tensor([0, 1, 15, 16, 17, shape[0] - 1])
    assert torch.equal(cpu_kernels.linear_weight_rows(prepared, rows), weight[rows])
    assert torch.equal(cpu_kernels.linear_weight_dense(prepared), weight)


@needs_c
@pytest.mark.parametrize("num_rows", [1, 6, 7, 64, 65, 300])
@pytest.mark.parametrize("op", ["none", "silu", "mul", "add"])
def test_every_kernel_reading_the_one_copy_equals_the_reference(num_rows, op):
    """Whatever :func:`route` sends these rows to (linear_small, linear_amx), from the one copy, equals the float32
    sum rounded once, as does the reference ``F.linear`` over the weight read back. Where the build has neither
    AVX512-BF16 nor AVX2 (row-major weights, no panels), rows above linear_small's limit take the reference path,
    which rounds the matmul before the op: it equals that."""
    from backend.engine.linear import Kernel, route
    from tests.unit.test_cpu_kernel import fused_reference

    gen = torch.Generator().manual_seed(num_rows)
    weight = (0.05 * torch.randn(96, 576, generator=gen)).bfloat16()
    linear = Linear(weight)
    assert linear.layout is c_layout()
    x = torch.randn(num_rows, 576, generator=gen).bfloat16()
    other = torch.randn(num_rows, 96, generator=gen).bfloat16() if op in ("mul", "add") else None
    if route(num_rows, linear) is Kernel.TORCH:
        expected = fused_reference(x, weight, None, "none", None)
        if op != "none":
            expected = fused_reference(expected, torch.eye(96).bfloat16(), None, op, other)  # the op, rounded again
    else:
        expected = fused_reference(x, weight, None, op, other)
    torch.testing.assert_close(linear(x, op, other), expected, atol=1e-3, rtol=2**-7)
    if route(num_rows, linear) is not Kernel.TORCH:
        reference = torch.nn.functional.linear(x, linear.dense_weight())
        torch.testing.assert_close(reference, (x.float() @ weight.float().T).bfloat16(), atol=1e-3, rtol=2**-7)


def bf16_config(model_dir: Path, **overrides) -> EngineConfig:
    values = dict(model=str(model_dir), dtype="bfloat16", num_kv_blocks=64, max_num_seqs=8, max_model_len=256,
                  num_threads=2)
    return EngineConfig(**{**values, **overrides})


@needs_c
def test_the_weight_file_is_built_once_and_mapped_read_only(tiny_llama_dir, tmp_path, monkeypatch):
    """The first engine writes the file; the next maps it (no checkpoint read), and both forwards agree with the
    engine that prepares its weights in process, to the bit. The tied embedding is read from the LM head's copy."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = bf16_config(tiny_llama_dir).resolve()
    dtype, device = torch.bfloat16, torch.device("cpu")
    path = weight_file.weights_path(Path(config.model), dtype)
    assert not path.exists()
    built = LlamaModel(config, dtype, device)
    assert path.exists() and not list(path.parent.glob("*.tmp"))
    stamp = path.stat().st_mtime_ns
    monkeypatch.setattr("backend.engine.model._load_safetensors", lambda _: pytest.fail("the checkpoint was read"))
    mapped = LlamaModel(config, dtype, device)
    assert path.stat().st_mtime_ns == stamp
    monkeypatch.undo()
    monkeypatch.setenv("LLM_WEIGHT_FILE", "0")
    in_process = LlamaModel(config, dtype, device)

    weights = [mapped.lm_head.weight] + [getattr(layer, p).weight for layer in mapped.layers
                                         for p in ("qkv", "o", "gate", "up", "down")]
    assert all(_in_file(w, path) for w in weights)
    assert mapped._embed is None  # tied: rows of the LM head's copy
    ids = torch.tensor([0, 5, 49151])
    from safetensors.torch import load_file

    checkpoint = load_file(str(Path(tiny_llama_dir) / "model.safetensors"))
    assert torch.equal(mapped.embed(ids), checkpoint["model.embed_tokens.weight"].bfloat16()[ids])
    for a, b, c in zip(*(m.layers for m in (built, mapped, in_process))):
        assert torch.equal(a.qkv.weight, b.qkv.weight) and torch.equal(b.qkv.weight, c.qkv.weight)
        assert torch.equal(b.down.weight, c.down.weight) and torch.equal(b.input_norm, c.input_norm)


def _in_file(tensor: torch.Tensor, path: Path) -> bool:
    """Whether ``tensor``'s memory lies in a read-only mapping of ``path`` (from /proc/self/maps)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            if start <= address < end:
                return fields[1].startswith("r-")  # mapped read-only
    return False


@needs_c
def test_a_changed_checkpoint_gets_another_file_and_stale_files_go(tiny_llama_dir, tmp_path, monkeypatch):
    """A changed checkpoint (or dtype) is another key; building its file deletes the folder's older one, and the
    files of folders that are gone."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    copies = [tmp_path / "model", tmp_path / "gone"]
    for model_dir in copies:
        model_dir.mkdir()
        for f in Path(tiny_llama_dir).iterdir():
            if f.is_file():
                (model_dir / f.name).write_bytes(f.read_bytes())

    def build(model_dir: Path) -> Path:
        LlamaModel(bf16_config(model_dir).resolve(), torch.bfloat16, torch.device("cpu"))
        return weight_file.weights_path(model_dir, torch.bfloat16)

    gone = build(copies[1])
    for f in copies[1].iterdir():
        f.unlink()
    copies[1].rmdir()
    first = build(copies[0])
    assert weight_file.weights_path(copies[0], torch.float16) != first
    os.utime(copies[0] / "model.safetensors", ns=(1, 1))
    second = build(copies[0])
    assert second != first and second.exists()
    assert not first.exists() and not gone.exists()


@needs_c
def test_engines_loading_at_once_build_one_file(tiny_llama_dir, tmp_path):
    """Three processes load the same model at once (as a server's models do): one file, no temporary left."""
    script = ("import sys, torch; from pathlib import Path; from backend.engine.model import LlamaModel; "
              "from tests.unit.test_weight_memory import bf16_config; "
              f"LlamaModel(bf16_config(Path({str(tiny_llama_dir)!r})).resolve(), torch.bfloat16, torch.device('cpu'))")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env) for _ in range(3)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    files = sorted(p.name for p in (tmp_path / "llm-batching-triton" / "weights").iterdir())
    assert len([f for f in files if f.endswith(".bin")]) == 1 and not [f for f in files if f.endswith(".tmp")]


MEASURE = """
import json, sys
from pathlib import Path
from backend.engine.openmp import set_wait_policy
set_wait_policy()
from backend.engine.sampling_params import SamplingParams
from backend.engine.llm_engine import LLMEngine
from tests.unit.test_weight_memory import bf16_config, memory_of

engine = LLMEngine(bf16_config(Path(sys.argv[1]), num_kv_blocks=512, max_model_len=2048))
engine.generate([[1, 2, 3, 4] * 16] * 8, SamplingParams(max_tokens=8, ignore_eos=True))
engine.generate([[5] * 300], SamplingParams(max_tokens=2, ignore_eos=True))
print(json.dumps({**memory_of("self"), "kv": engine.runner.kv_cache_bytes}), flush=True)
sys.stdin.readline()  # held until the test has read what it shares
"""


def memory_of(pid: str | int) -> dict[str, int]:
    """Resident and proportional set size, in bytes, from /proc/PID/smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return {"rss": fields["Rss"], "pss": fields["Pss"]}


@needs_c
@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.timeout(300)
def test_one_engine_holds_its_weights_once_and_shares_them(smollm2_dir):
    """SmolLM2 in a fresh process: resident and proportional memory within weights + KV pool + 400 MiB; the weights
    are the file's pages, so a second process mapping the file takes half of their proportional share."""
    weights = sum(f.stat().st_size for f in Path(smollm2_dir).glob("*.safetensors"))
    proc = subprocess.Popen([sys.executable, "-c", MEASURE, str(smollm2_dir)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        measured = json.loads(proc.stdout.readline())
        bound = weights + measured["kv"] + OVERHEAD_MIB * MIB
        summary = {k: f"{v / MIB:,.0f} MiB" for k, v in {**measured, "bound": bound}.items()}
        assert measured["rss"] <= bound and measured["pss"] <= bound, summary
        if c_layout() is Layout.PACKED or c_layout() is Layout.ROW_MAJOR:
            alone = memory_of(proc.pid)["pss"]
            path = weight_file.weights_path(Path(smollm2_dir), torch.bfloat16)
            shared = weight_file.read(path)  # this process maps the same file and reads a byte of every page
            for value in shared.values():
                int((value.weight if isinstance(value, Linear) else value).reshape(-1).view(torch.uint8)[::4096].sum())
            together = memory_of(proc.pid)["pss"]
            assert alone - together >= 0.4 * weights, {"alone": alone / MIB, "together": together / MIB}
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
