"""The models' inputs and outputs are declared once (backend/contract/io_schema.py): what each model adds to its config
when Triton loads it, and the places that read them (the stub's parsing and responses, the client, the pbtxt files,
model_repository/README.md's tables) agree with it. tests/server/test_models.py reads a served model's config."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from backend.contract import io_schema
from backend.triton.launcher import config_text
from backend.triton.stub import parsing, responses
from backend.triton.stub.model_config import complete_config, engine_config_from_triton
from client.schema import INPUT_TYPES, GenerationRequest

ROOT = Path(__file__).resolve().parents[2]
MODELS = sorted((ROOT / "model_repository").glob("*/config.pbtxt"))


class ModelConfigStandIn:
    """``pb_utils.ModelConfig``'s part that ``auto_complete_config`` uses: add an input or output unless one of that
    name is there (Triton 2.51's refuses a different type or shape; here any difference is refused)."""

    def __init__(self, config: dict) -> None:
        self._config = {"input": [], "output": [], **config}

    def as_dict(self) -> dict:
        return self._config

    def add_input(self, tensor: dict) -> None:
        self._add("input", tensor)

    def add_output(self, tensor: dict) -> None:
        self._add("output", tensor)

    def _add(self, kind: str, tensor: dict) -> None:
        same = [t for t in self._config[kind] if t["name"] == tensor["name"]]
        if same and same[0] != tensor:
            raise ValueError(f"{kind} {tensor['name']}: config says {same[0]}, the model {tensor}")
        if not same:
            self._config[kind].append(dict(tensor))


def completed(smollm2_dir, parameters: dict[str, str], declared: dict | None = None) -> dict:
    config = {"name": "llm_x", "parameters": {"model": {"string_value": str(smollm2_dir)},
                                              **{k: {"string_value": v} for k, v in parameters.items()}}}
    stand_in = ModelConfigStandIn({**config, **(declared or {})})
    assert complete_config(stand_in, str(ROOT / "model_repository" / "llm_x")) is stand_in
    return stand_in.as_dict()


def test_a_loading_model_adds_every_input_and_output_and_publishes_the_max_model_len_its_engine_resolves(smollm2_dir):
    config = completed(smollm2_dir, {})
    assert [t["name"] for t in config["input"]] == list(io_schema.INPUT_NAMES)
    assert [t["name"] for t in config["output"]] == list(io_schema.OUTPUT_NAMES)
    assert config["input"][0] == {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": False}
    assert all(t["optional"] for t in config["input"][1:])
    stop = next(t for t in config["input"] if t["name"] == "stop")
    assert stop["dims"] == [-1] and config["output"][1] == {"name": "output_ids", "data_type": "TYPE_INT32",
                                                            "dims": [-1]}
    # unset: the model's own length (SmolLM2: 8192 positions); the engine resolves the published config to the same
    assert io_schema.served_max_model_len(config) == 8192
    engine_config = engine_config_from_triton(config, str(ROOT / "model_repository" / "llm_x"))
    assert engine_config.resolve().max_model_len == 8192
    assert io_schema.served_max_model_len(completed(smollm2_dir, {"max_model_len": "2048"})) == 2048
    unchunked = completed(smollm2_dir, {"enable_chunked_prefill": "false", "max_num_batched_tokens": "1024"})
    assert io_schema.served_max_model_len(unchunked) == 1024


def test_a_config_that_declares_a_tensor_as_the_schema_does_loads_and_one_that_differs_does_not(smollm2_dir):
    same = {"input": [io_schema.BY_NAME["top_k"].as_input()]}
    assert len(completed(smollm2_dir, {}, same)["input"]) == len(io_schema.INPUTS)
    other = {"input": [{**io_schema.BY_NAME["top_k"].as_input(), "data_type": "TYPE_FP32"}]}
    with pytest.raises(ValueError, match="top_k"):
        completed(smollm2_dir, {}, other)


def test_a_model_whose_engine_settings_are_wrong_fails_to_load_with_the_engines_message(smollm2_dir):
    with pytest.raises(ValueError, match="max_model_len .*9000.* exceeds the model's max_position_embeddings"):
        completed(smollm2_dir, {"max_model_len": "9000"})


def test_the_shipped_configs_declare_no_inputs_or_outputs_of_their_own():
    """An operator's config.pbtxt holds what an operator tunes; the schema is the model's."""
    assert len(MODELS) == 4
    for path in MODELS:
        config = config_text.load(path)
        assert not config.input and not config.output, path


def test_the_stub_reads_and_writes_exactly_the_schema():
    assert parsing.ALL_INPUTS == io_schema.INPUT_NAMES and responses.ALL_OUTPUTS == set(io_schema.OUTPUT_NAMES)
    sorted_out = {*parsing.SAMPLING_INPUTS, *parsing.SAMPLING_INPUT_ALIASES, *parsing.RETURN_INPUTS,
                  parsing.RETURN_LOGPROBS, "text_input", "stop", "stream", "sampling_parameters",
                  "exclude_input_in_output", "priority"}
    assert sorted_out == set(io_schema.INPUT_NAMES)  # every input has its reader; none is read that is not declared
    assert responses.INTERMEDIATE_OUTPUTS <= responses.ALL_OUTPUTS and responses.OPT_IN_OUTPUTS <= responses.ALL_OUTPUTS


def test_the_client_sends_the_schemas_names_and_types():
    assert list(INPUT_TYPES) == [f.name for f in fields(GenerationRequest)]
    assert {name: datatype for name, (datatype, _) in INPUT_TYPES.items()} == {
        name: io_schema.BY_NAME[name].wire_type for name in INPUT_TYPES}


def _readme_table(heading: str) -> dict[str, tuple[str, str]]:
    """``name -> (type, shape)`` from model_repository/README.md's table whose first column is ``heading``; a row
    may name several tensors."""
    text = (ROOT / "model_repository" / "README.md").read_text()
    table = text[text.index(f"| {heading} | type | shape |"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        names, datatype, shape = (cell.strip() for cell in line.split("|")[1:4])
        for name in re.findall(r"`(\w+)`", names):
            rows[name] = (datatype, shape.strip("`"))
    return rows


@pytest.mark.parametrize("heading, tensors", [("input", io_schema.INPUTS), ("output", io_schema.OUTPUTS)])
def test_the_readmes_tables_are_the_schema(heading, tensors):
    expected = {t.name: (t.wire_type, str(list(t.dims)).replace(" ", "")) for t in tensors}
    assert _readme_table(heading) == expected
