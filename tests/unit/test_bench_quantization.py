"""``make bench --quantization``: the option reaches the engines' settings and the served copies' configs, the table
says the format, and the llama.cpp column serves the GGUF of that format (or the one given). No engine, no server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backend.kernels.weight_format import WeightFormat
from backend.triton.launcher import config_text
from bench import engine, engine_table
from bench.llamacpp import default_gguf, llamacpp_column
from bench.served import served_repository
from tests.unit.test_bench_llamacpp import fake_result

SERVER = "/a/.llamacpp/bin/llama-server"
MODEL = "models/smollm2-135m-instruct"


def test_default_gguf_follows_the_weight_format():
    assert str(default_gguf(SERVER, MODEL)) == "/a/.llamacpp/smollm2-135m-instruct-bf16.gguf"
    assert str(default_gguf(SERVER, MODEL, WeightFormat.BF16)) == "/a/.llamacpp/smollm2-135m-instruct-bf16.gguf"
    # The file `make llamacpp` links beside the BF16 one: the Q4_1 GGUF the model ships as.
    assert str(default_gguf(SERVER, MODEL, WeightFormat.Q4_1)) == "/a/.llamacpp/smollm2-135m-instruct-q4_1.gguf"
    assert str(default_gguf(SERVER, MODEL + "/", WeightFormat.Q4_1)) == "/a/.llamacpp/smollm2-135m-instruct-q4_1.gguf"
    # No int8 GGUF is made (llama.cpp's Q8_0 is not the engine's per-channel int8): BF16 is its baseline.
    assert str(default_gguf(SERVER, MODEL, WeightFormat.INT8)) == "/a/.llamacpp/smollm2-135m-instruct-bf16.gguf"


def test_the_makefile_links_the_q4_1_gguf_where_default_gguf_looks():
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    assert "LLAMACPP_Q4_GGUF := $(LLAMACPP_DIR)/$(notdir $(MODEL))-q4_1.gguf" in makefile
    assert "LLAMACPP_GGUF := $(LLAMACPP_DIR)/$(notdir $(MODEL))-bf16.gguf" in makefile


@pytest.mark.parametrize("quantization, gguf, expected", [
    (WeightFormat.Q4_1, None, "smollm2-135m-instruct-q4_1.gguf"),
    (None, None, "smollm2-135m-instruct-bf16.gguf"),
    (WeightFormat.Q4_1, "elsewhere/my-own.gguf", "my-own.gguf"),  # an explicit GGUF wins over the format's
])
def test_llamacpp_column_serves_the_chosen_gguf(tmp_path, quantization, gguf, expected):
    # Nothing there: the column refuses before it starts a server, naming the file it would have served.
    server = tmp_path / ".llamacpp" / "bin" / "llama-server"
    gguf = None if gguf is None else tmp_path / gguf
    with pytest.raises(FileNotFoundError, match=re.escape(expected)):
        llamacpp_column(server, MODEL, 2, (1,), [[1, 2, 3]], 4, 1, 0, log=lambda msg: None, gguf=gguf,
                        quantization=quantization)


class Captured(Exception):
    pass


def settings_of(argv: list[str], monkeypatch) -> engine.BenchSettings:
    """The settings ``engine.main`` would run, without running them."""
    def run_bench(settings, log=print):
        raise Captured(settings)

    monkeypatch.setattr(engine, "run_bench", run_bench)
    with pytest.raises(Captured) as caught:
        engine.main(argv)
    return caught.value.args[0]


def test_bench_options_reach_the_settings(monkeypatch):
    default = settings_of(["--quick"], monkeypatch)
    assert default.quantization is None and default.weight_format is WeightFormat.BF16
    assert default.llamacpp_gguf is None
    assert settings_of(["--quick", "--quantization", "bf16"], monkeypatch).quantization is None
    quantized = settings_of(["--quick", "--quantization", "q4_1", "--llamacpp", SERVER, "--llamacpp-gguf",
                             "/g/m-q4_1.gguf"], monkeypatch)
    assert quantized.quantization is quantized.weight_format is WeightFormat.Q4_1
    assert quantized.llamacpp == SERVER and quantized.llamacpp_gguf == "/g/m-q4_1.gguf"
    assert settings_of(["--quantization", "int8"], monkeypatch).quantization is WeightFormat.INT8
    with pytest.raises(SystemExit):
        engine.main(["--quantization", "q4_0"])
    with pytest.raises(SystemExit):  # a GGUF without the server that would serve it
        engine.main(["--llamacpp-gguf", "/g/m-q4_1.gguf"])


def test_served_copies_run_the_format(tmp_path):
    models = ("llm_continuous", "llm_dynamic")
    quantized = served_repository(tmp_path / "q", models, 8, quantization="q4_1")
    as_shipped = served_repository(tmp_path / "bf16", models, 8)
    for model in models:
        config = config_text.load(quantized / model / "config.pbtxt")
        shipped = config_text.load(as_shipped / model / "config.pbtxt")
        assert config_text.parameter(config, "quantization") == "q4_1"
        assert config_text.parameter(shipped, "quantization") is None
        del config.parameters["quantization"]
        assert config == shipped


def test_the_table_says_the_format():
    result = fake_result({1: 17.0, 8: 30.0}, {1: 15.0, 8: 60.0})
    table = engine_table.format_table(result)
    assert table.splitlines()[0].startswith("model m  weights bf16  dtype bfloat16")  # an older result: bf16
    result["config"]["quantization"] = "q4_1"
    result["llamacpp"]["gguf"] = "/a/m-q4_1.gguf"
    lines = engine_table.format_table(result).splitlines()
    assert lines[0].startswith("model m  weights q4_1  dtype bfloat16")
    assert any(line.startswith("1. Fixed batches") and "the engine on q4_1 weights, HF generate on bf16" in line
               for line in lines)
    assert any(line.startswith("2. Served") and "(q4_1 weights," in line for line in lines)
    assert any(line.startswith("2b. llama.cpp") and "on m-q4_1.gguf" in line for line in lines)
