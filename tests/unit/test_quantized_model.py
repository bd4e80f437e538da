"""Quantized weights in the engine: the setting, the GGUF's own blocks, the routing, the decode stack and the file of
prepared weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from backend.engine import weight_file
from backend.engine.config import GGUF_BLOCKS, EngineConfig, ModelShape
from backend.engine.linear import QUANTIZED_ROWS, Kernel, Layout, Linear, make_linear, route
from backend.engine.model import prepare_weights
from backend.kernels import cpu_kernels
from backend.kernels.quantized_linear import dequantize, group_rows
from backend.kernels.weight_format import WeightFormat
from backend.triton.stub.model_config import engine_config_from_triton
from tests.unit.test_model_forward import CountedStack, decode_inputs, decode_runner

needs_c = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: the torch path is used")


# ---- the setting --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("given, held", [(None, None), ("", None), ("none", None), ("Q4_1", WeightFormat.Q4_1),
                                         (" int8 ", WeightFormat.INT8), (WeightFormat.INT8, WeightFormat.INT8)])
def test_quantization_is_validated_and_normalised(given, held):
    assert EngineConfig(quantization=given).quantization is held


@pytest.mark.parametrize("settings, words", [
    ({"quantization": "fp8"}, "q4_1, int8 or none"),
    ({"quantization": "q8_0"}, "q4_1, int8 or none"),  # a format the engine holds, but only as q4_1's LM head
    ({"quantization": "q4_1", "dtype": "float32"}, "set dtype=bfloat16"),
    ({"quantization": "int8", "device": "cuda"}, "set device=cpu"),
])
def test_quantization_refuses_what_it_cannot_serve_with_a_way_out(settings, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(**settings)


def test_quantization_comes_through_the_triton_model_config(smollm2_dir, tmp_path):
    params = {"model": {"string_value": str(smollm2_dir)}, "quantization": {"string_value": "q4_1"}}
    config = engine_config_from_triton({"parameters": params}, str(tmp_path / "m" / "1"))
    assert config.quantization is WeightFormat.Q4_1
    params["quantization"] = {"string_value": ""}  # as config.pbtxt leaves it: the weights in dtype
    assert engine_config_from_triton({"parameters": params}, str(tmp_path / "m" / "1")).quantization is None


# ---- the GGUF's blocks, as prepare_weights holds them -------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_weights(smollm2_dir):
    return load_file(str(Path(smollm2_dir) / "model.safetensors"))


def test_gguf_blocks_are_the_checkpoints_numbers_in_the_ggufs_formats(smollm2_dir, smollm2_weights):
    """prepare_model keeps the GGUF's Q4_1 projections and Q8_0 embedding beside the bf16 checkpoint converted from
    the same file: widened and rounded to bf16 they are the checkpoint's tensors exactly (Q and K rows included,
    which llama.cpp's converter permutes)."""
    blocks = weight_file.gguf_blocks(Path(smollm2_dir))
    assert blocks is not None, "make model keeps the GGUF's blocks"
    formats = {fmt for fmt, _ in blocks.values()}
    assert formats == {WeightFormat.Q4_1, WeightFormat.Q8_0}
    assert blocks["model.embed_tokens.weight"][0] is WeightFormat.Q8_0
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
                 "model.layers.7.mlp.down_proj.weight", "model.embed_tokens.weight"):
        fmt, rows = blocks[name]
        assert torch.equal(dequantize(fmt, group_rows(fmt, rows)).to(torch.bfloat16), smollm2_weights[name]), name


def test_prepared_q4_1_holds_the_gguf_blocks_fused_and_the_lm_head_in_q8_0(smollm2_dir, smollm2_weights):
    shape = ModelShape.from_model_dir(smollm2_dir)
    blocks = weight_file.gguf_blocks(Path(smollm2_dir))
    prepared = prepare_weights(smollm2_weights, shape, torch.bfloat16, WeightFormat.Q4_1, blocks)
    qkv = prepared["3.qkv"]
    assert qkv.layout is Layout.Q4_1 and prepared["lm_head"].layout is Layout.Q8_0 and "embed" not in prepared
    want = torch.cat([smollm2_weights[f"model.layers.3.self_attn.{q}_proj.weight"] for q in "qkv"])
    assert torch.equal(qkv.dense_weight(), want)
    rows = torch.tensor([0, 17, 49151])
    assert torch.equal(prepared["lm_head"].weight_rows(rows), smollm2_weights["model.embed_tokens.weight"][rows])


def test_int8_is_quantized_at_load_every_projection_and_the_lm_head(smollm2_dir, smollm2_weights):
    shape = ModelShape.from_model_dir(smollm2_dir)
    prepared = prepare_weights(smollm2_weights, shape, torch.bfloat16, WeightFormat.INT8)
    layouts = {value.layout for value in prepared.values() if isinstance(value, Linear)}
    assert layouts == {Layout.INT8}
    down = smollm2_weights["model.layers.0.mlp.down_proj.weight"].float()
    step = down.abs().amax(dim=1, keepdim=True) / 127  # per output channel
    assert bool(((prepared["0.down"].dense_weight().float() - down).abs() <= 0.5 * step + 2**-8 * down.abs()).all())


# ---- routing and the decode stack ---------------------------------------------------------------------------------


@needs_c
def test_routing_sends_few_rows_to_the_quantized_kernel_and_many_through_bf16():
    linear = make_linear(torch.randn(64, 96).to(torch.bfloat16), None, WeightFormat.Q4_1)
    assert linear.layout is Layout.Q4_1
    limit = QUANTIZED_ROWS
    assert [route(n, linear) for n in (1, limit, limit + 1)] == [Kernel.C_QUANTIZED, Kernel.C_QUANTIZED,
                                                                 Kernel.DEQUANTIZED]
    x = torch.randn(limit + 5, 96).to(torch.bfloat16)
    reference = torch.nn.functional.linear(x.float(), linear.dense_weight().float())
    # both routes agree with the bf16-widened weight's matmul within that widening (2^-9 of each weight, the C
    # kernel widens to float32) and the output's rounding
    bound = 2.0**-8 * (x.float().abs() @ linear.dense_weight().float().abs().T) + 2.0**-7 * reference.abs()
    for rows in (3, limit + 5):
        assert bool(((linear(x[:rows]).float() - reference[:rows]).abs() <= bound[:rows]).all()), rows
    not_whole_blocks = torch.randn(8, 40).to(torch.bfloat16)  # K % 32
    assert make_linear(not_whole_blocks, None, WeightFormat.Q4_1).layout is not Layout.Q4_1


@needs_c
@pytest.mark.parametrize("quantization", ["q4_1", "int8"])
@pytest.mark.parametrize("batch", [1, 9])
def test_quantized_decode_stack_equals_the_layer_by_layer_forward_to_the_bit(tiny_llama_dir, quantization, batch,
                                                                             monkeypatch):
    """With every projection quantized, a small decode step runs every layer in one C call with the quantized
    kernels; the same step layer by layer (the same kernels from Python) gives the same logits exactly, and the
    weights widened to bf16 through the bf16 matmuls give them within bf16 rounding."""
    runner = decode_runner(tiny_llama_dir, quantization)
    stack = runner.model.decode_stack
    assert stack is not None and stack.weight_format == quantization
    inputs = decode_inputs(runner, ([5, 9, 3] * 3)[:batch])
    counted = CountedStack(stack)

    def decode(decode_stack, quantized_rows=QUANTIZED_ROWS):
        monkeypatch.setattr(runner.model, "decode_stack", decode_stack)
        monkeypatch.setattr("backend.engine.linear.QUANTIZED_ROWS", quantized_rows)
        return runner.run(inputs).clone()

    stacked = decode(counted)
    assert counted.num_calls, "the step did not take the decode stack"
    torch.testing.assert_close(stacked, decode(None), atol=0, rtol=0)
    widened = decode(None, quantized_rows=0)  # every projection through the weight widened to bf16
    torch.testing.assert_close(stacked.float(), widened.float(), atol=0.05, rtol=0.05)


# ---- the file of prepared weights ---------------------------------------------------------------------------------


@needs_c
def test_each_quantization_maps_its_own_weight_file(smollm2_dir, tmp_path, monkeypatch):
    """The file is keyed by the quantization: a q4_1 engine maps a file of Q4_1 blocks (a tenth of a bf16 file's
    pages fewer than half), and a second engine maps the same file."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model_dir = Path(smollm2_dir)
    paths = {q: weight_file.weights_path(model_dir, torch.bfloat16, q)
             for q in (None, WeightFormat.Q4_1, WeightFormat.INT8)}
    assert len(set(paths.values())) == 3
    config = EngineConfig(model=str(model_dir), quantization="q4_1", num_kv_blocks=16, max_model_len=256).resolve()
    from backend.engine.model import LlamaModel

    first = LlamaModel(config, torch.bfloat16, torch.device("cpu"))
    assert paths[WeightFormat.Q4_1].exists() and not paths[None].exists()
    second = LlamaModel(config, torch.bfloat16, torch.device("cpu"))
    assert second.layers[0].qkv.layout is Layout.Q4_1 and second.lm_head.layout is Layout.Q8_0
    assert torch.equal(first.layers[5].down.weight, second.layers[5].down.weight)
    with open(paths[WeightFormat.Q4_1], "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        index = json.loads(f.read(length))["tensors"]
    assert index["0.qkv"]["layout"] == "q4_1" and index["0.qkv"]["weight"]["dtype"] == "uint8"  # as files hold it
    # Q4_1's 0.625 bytes a weight (and Q8_0's 1.06 for the LM head) against bf16's 2
    assert paths[WeightFormat.Q4_1].stat().st_size < 0.45 * 2 * sum(p.numel() for p in load_file(
        str(model_dir / "model.safetensors")).values())


def test_blocks_file_is_where_prepare_model_writes_it(smollm2_dir):
    assert (Path(smollm2_dir) / GGUF_BLOCKS).is_file()
