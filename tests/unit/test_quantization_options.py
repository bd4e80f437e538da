"""``make compare`` and ``make slo`` with ``--quantization``: the option reaches every served copy's config.pbtxt
as the engine parameter, and the report names the weights. No server: the load stops where the server would start."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from backend.contract.names import CONTINUOUS, DYNAMIC, MODELS
from backend.engine import config
from backend.engine.config import EngineConfig
from backend.triton.launcher import config_text
from loadtest import compare, report, runner, slo
from loadtest.runner import (
    REPO_ROOT,
    WEIGHT_FORMATS,
    DynamicVariant,
    batcher_settings,
    engine_parameters,
    served_repository,
    weight_format,
)

FIXTURE = Path(__file__).parents[1] / "data" / "loadtest_results.json"
SHIPPED = REPO_ROOT / "model_repository"


def parameters_of(config_pbtxt: Path) -> dict[str, str]:
    """The string parameters of a config.pbtxt."""
    return {key: value.string_value for key, value in config_text.load(config_pbtxt).parameters.items()}


def test_the_load_tests_offer_the_engines_formats():
    # Listed in loadtest.runner (a load test does not import the engine): held equal to the engine's here.
    assert WEIGHT_FORMATS == config.WEIGHT_FORMATS
    assert EngineConfig(quantization="none").quantization is None  # what --quantization bf16 writes


@pytest.mark.timeout(10)
def test_compare_takes_quantization_and_makes_it_an_engine_parameter():
    assert compare.parse_args(["--smoke"]).quantization is None
    assert engine_parameters(compare.parse_args(["--smoke"])) == {}  # default: the repository as shipped
    assert engine_parameters(compare.parse_args(["--smoke", "--quantization", "q4_1"])) == {"quantization": "q4_1"}
    assert engine_parameters(compare.parse_args(["--quantization", "int8"])) == {"quantization": "int8"}
    assert engine_parameters(compare.parse_args(["--quantization", "bf16"])) == {"quantization": "none"}
    with pytest.raises(SystemExit):
        compare.parse_args(["--quantization", "q4_0"])
    with pytest.raises(SystemExit):  # a running server's configs are its own
        compare.parse_args(["--url", "http://127.0.0.1:8000", "--quantization", "q4_1"])
    assert engine_parameters(slo.parse_args(["--quantization", "q4_1"])) == {"quantization": "q4_1"}
    with pytest.raises(SystemExit):
        slo.parse_args(["--url", "http://127.0.0.1:8000", "--quantization", "q4_1"])


@pytest.mark.timeout(10)
def test_served_repository_sets_quantization_on_every_model_and_variant(tmp_path):
    variant = DynamicVariant(2, 4, 2000)
    models = [*MODELS, variant.name]
    served_repository(SHIPPED, tmp_path, models, [variant], {"quantization": "q4_1"})
    for model in models:
        params = parameters_of(tmp_path / model / "config.pbtxt")
        assert params["quantization"] == "q4_1", model
        shipped = parameters_of(SHIPPED / (DYNAMIC if model == variant.name else model) / "config.pbtxt")
        for key in ("dtype", "kv_cache_memory_bytes", "batching"):  # the rest as shipped
            assert params[key] == shipped[key], (model, key)
        assert params["model"] == str(SHIPPED.resolve().parent / shipped["model"])  # the folder the source meant
    assert parameters_of(tmp_path / variant.name / "config.pbtxt")["max_num_seqs"] == "4"  # the variant's own


@pytest.mark.timeout(10)
def test_served_repository_without_parameters_leaves_the_weights_as_shipped(tmp_path):
    served_repository(SHIPPED, tmp_path, list(MODELS), [])
    for model in MODELS:
        params = parameters_of(tmp_path / model / "config.pbtxt")
        shipped = parameters_of(SHIPPED / model / "config.pbtxt")
        assert params.pop("model") == str(SHIPPED.resolve().parent / shipped.pop("model"))
        assert params == shipped


class ServerStartsHere(Exception):
    pass


def stop_where_the_server_starts(monkeypatch) -> dict:
    """Replace ``runner.open_target`` (compare's and slo's): record the repository it would serve, then fail as a
    server that did not start would (compare and slo catch it and return 1)."""
    seen = {}

    @contextlib.contextmanager
    def open_target(args, log_path, say=print):
        seen["model_repository"] = Path(args.model_repository)
        raise ServerStartsHere("stopped before the server starts")
        yield  # pragma: no cover

    monkeypatch.setattr(runner, "open_target", open_target)
    return seen


class QuietPage:
    def __init__(self, view, port):
        self.view, self.url = view, "http://127.0.0.1:0/"

    def start(self):
        return self

    def stop(self):
        pass


@pytest.mark.timeout(30)
def test_compare_serves_a_copy_with_quantization_on_every_model(tmp_path, monkeypatch):
    seen = stop_where_the_server_starts(monkeypatch)
    monkeypatch.setattr(compare.live, "LivePage", QuietPage)
    argv = ["--smoke", "--quantization", "q4_1", "--dynamic-variants", "", "--out", str(tmp_path)]
    assert compare.main(argv) == 1
    served = seen["model_repository"]
    assert served.parent.parent == tmp_path and served.name == "model_repository"  # the report's own copy
    for model in MODELS:
        assert parameters_of(served / model / "config.pbtxt")["quantization"] == "q4_1"


@pytest.mark.timeout(30)
def test_compare_without_quantization_serves_the_shipped_repository(tmp_path, monkeypatch):
    seen = stop_where_the_server_starts(monkeypatch)
    monkeypatch.setattr(compare.live, "LivePage", QuietPage)
    assert compare.main(["--smoke", "--dynamic-variants", "", "--out", str(tmp_path)]) == 1
    assert seen["model_repository"] == SHIPPED


@pytest.mark.timeout(30)
def test_slo_serves_a_copy_with_quantization(tmp_path, monkeypatch):
    seen = stop_where_the_server_starts(monkeypatch)
    assert slo.main(["--quantization", "int8", "--models", f"{DYNAMIC},{CONTINUOUS}", "--out", str(tmp_path)]) == 1
    served = seen["model_repository"]
    assert sorted(p.name for p in served.iterdir()) == [CONTINUOUS, DYNAMIC]
    for model in (DYNAMIC, CONTINUOUS):
        assert parameters_of(served / model / "config.pbtxt")["quantization"] == "int8"


def test_weight_format_reads_the_served_parameters():
    assert weight_format({}) == "bf16"
    assert weight_format({"dtype": "bfloat16", "quantization": None}) == "bf16"
    assert weight_format({"dtype": "bfloat16", "quantization": "none"}) == "bf16"
    assert weight_format({"dtype": "bfloat16", "quantization": "q4_1"}) == "q4_1"
    assert weight_format({"dtype": "float32"}) == "float32"
    config = {"parameters": {"dtype": {"string_value": "bfloat16"}, "quantization": {"string_value": "int8"}}}
    assert weight_format(batcher_settings(config)) == "int8"


def served_config(quantization: str | None) -> dict:
    parameters = {"max_num_seqs": {"string_value": "8"}, "dtype": {"string_value": "bfloat16"}}
    if quantization:
        parameters["quantization"] = {"string_value": quantization}
    return {"max_batch_size": 0, "instance_group": [{"count": 1}], "parameters": parameters}


@pytest.mark.timeout(60)
def test_report_names_the_weight_format(tmp_path):
    results = json.loads(FIXTURE.read_text())
    models = sorted({run["model"] for run in results["runs"]})
    results["meta"]["quantization"] = "q4_1"
    results["meta"]["configs"] = {model: batcher_settings(served_config("q4_1")) for model in models}
    report.build(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# Continuous vs dynamic batching on Triton: measured (q4_1 weights)\n")
    assert "Weights: q4_1 on every model (--quantization)." in md
    table = md.split("## Configurations served")[1].split("\n\n")[1].splitlines()
    assert table[0].endswith("| KV blocks | weights |")
    assert all(row.endswith("| q4_1 |") for row in table[2:])
    html = (tmp_path / "report.html").read_text()
    assert "(q4_1 weights)" in html and "Weights: q4_1 on every model" in html


def test_report_says_bf16_and_mixed_formats():
    as_shipped = {"configs": {m: batcher_settings(served_config(None)) for m in (DYNAMIC, CONTINUOUS)}}
    assert report.weight_formats(as_shipped) == ["bf16"]
    assert report._weights_text(as_shipped) == "Weights: bf16 on every model (as configured)."
    mixed = {"configs": {DYNAMIC: batcher_settings(served_config(None)),
                         CONTINUOUS: batcher_settings(served_config("int8"))}}
    assert report._weights_text(mixed) == f"Weights: {DYNAMIC} bf16, {CONTINUOUS} int8."
    assert report.weight_formats({"quantization": "q4_1"}) == ["q4_1"]  # no configs read: what was asked for
    assert report.weight_formats({}) == []
