"""``backend.triton.launcher.config_text``: every shipped config.pbtxt reads as Triton's ModelConfig and survives a
write; the edits set fields and refuse the ones a config does not have; ``copy_model_repository`` writes through it.
No server (tests/server/test_loadtest.py serves a written copy)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from backend.contract import io_schema
from backend.contract.names import CONTINUOUS, DYNAMIC, ITERATIVE, MODELS, STATIC
from backend.contract.priority import DEFAULT_PRIORITY_LEVEL, PRIORITY_LEVELS
from backend.triton.launcher import config_text
from backend.triton.launcher.launch_options import copy_model_repository

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "model_repository"


def shipped(model: str) -> config_text.ModelConfig:
    return config_text.load(SHIPPED / model / "config.pbtxt")


@pytest.mark.parametrize("path", sorted(SHIPPED.glob("*/config.pbtxt")), ids=lambda p: p.parent.name)
def test_every_shipped_config_reads_and_round_trips(path, tmp_path):
    config = config_text.load(path)
    assert config.name == path.parent.name and config.backend == "python"
    assert config.model_transaction_policy.decoupled
    assert config_text.parameter(config, "batching") in ("continuous", "run_to_completion", "iterative")
    assert not config.input and not config.output  # declared once: backend/contract/io_schema.py
    config_text.save(config, tmp_path / "config.pbtxt")
    assert config_text.load(tmp_path / "config.pbtxt") == config


def test_the_shipped_models_are_the_configs_read():
    assert sorted(p.parent.name for p in SHIPPED.glob("*/config.pbtxt")) == sorted(MODELS)
    assert shipped(STATIC).dynamic_batching.preferred_batch_size == [8]
    assert shipped(ITERATIVE).sequence_batching.oldest.max_candidate_sequences == 8
    assert shipped(CONTINUOUS).max_batch_size == 0
    assert config_text.parameter(shipped(DYNAMIC), "max_num_seqs") == "8"


def test_parameters_are_replaced_or_added_and_may_be_required():
    config = shipped(DYNAMIC)
    config_text.set_parameters(config, {"max_num_seqs": 16, "quantization": "q4_1"})
    assert config_text.parameter(config, "max_num_seqs") == "16"
    assert config_text.parameter(config, "quantization") == "q4_1"
    assert config_text.parameter(config, "nothing") is None and "nothing" not in config.parameters  # read, not added
    with pytest.raises(ValueError, match="no parameter 'num_threads'"):
        config_text.set_parameters(config, {"dtype": "float32", "num_threads": "2"}, add_missing=False)
    assert config_text.parameter(config, "dtype") == "bfloat16"  # nothing set when one is refused


def test_batcher_edits_refuse_what_the_config_does_not_have():
    continuous, dynamic, iterative = shipped(CONTINUOUS), shipped(DYNAMIC), shipped(ITERATIVE)
    with pytest.raises(ValueError, match="max_batch_size 0"):
        config_text.set_max_batch_size(continuous, 8)
    with pytest.raises(ValueError, match="at least 1"):
        config_text.set_max_batch_size(dynamic, 0)
    for config in (continuous, iterative):
        with pytest.raises(ValueError, match="no dynamic_batching"):
            config_text.dynamic_batching(config)
    for config in (continuous, dynamic):
        with pytest.raises(ValueError, match="no sequence_batching"):
            config_text.oldest_sequence_batching(config)
    assert not continuous.HasField("dynamic_batching") and not dynamic.HasField("sequence_batching")  # none added

    config_text.set_max_batch_size(dynamic, 4)
    config_text.dynamic_batching(dynamic).default_queue_policy.max_queue_size = 3
    config_text.set_instance_count(dynamic, 2)
    config_text.oldest_sequence_batching(iterative).max_candidate_sequences = 96
    assert dynamic.max_batch_size == 4 and dynamic.instance_group[0].count == 2
    assert dynamic.dynamic_batching.default_queue_policy.max_queue_size == 3
    assert iterative.sequence_batching.oldest.max_candidate_sequences == 96
    dynamic.instance_group.add(count=1)
    with pytest.raises(ValueError, match="2 instance groups"):
        config_text.set_instance_count(dynamic, 3)


def test_edit_writes_back_only_a_block_that_ended_well(tmp_path):
    path = tmp_path / "config.pbtxt"
    shutil.copy(SHIPPED / DYNAMIC / "config.pbtxt", path)
    with pytest.raises(ValueError):
        with config_text.edit(path) as config:
            config.max_batch_size = 2
            config_text.oldest_sequence_batching(config)
    assert path.read_text() == (SHIPPED / DYNAMIC / "config.pbtxt").read_text()
    with config_text.edit(path) as config:
        config.name = "renamed"
    assert config_text.load(path).name == "renamed" and "#" not in path.read_text()  # a written copy: no comments


def test_a_config_triton_could_not_read_is_refused_with_its_path(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text('name: "x"\nmax_batch_sise: 8\n')
    with pytest.raises(ValueError, match=r"config\.pbtxt: not a Triton model config: .*max_batch_sise"):
        config_text.load(path)


def test_copy_model_repository_sets_parameters_and_leaves_an_unchanged_copy_as_it_was(tmp_path):
    # A JSON value (fault injection) is written as the text format quotes it, and read back as it was.
    faults = json.dumps({"stall": "a \"quoted\" \\ prompt"})
    copy_model_repository(tmp_path / "set", [DYNAMIC, ITERATIVE], {"fault_injection": faults, "max_num_seqs": "2"})
    copy_model_repository(tmp_path / "as_is", [STATIC, CONTINUOUS])
    for folder, model in ((tmp_path / "set", DYNAMIC), (tmp_path / "set", ITERATIVE),
                          (tmp_path / "as_is", STATIC), (tmp_path / "as_is", CONTINUOUS)):
        config = config_text.load(folder / model / "config.pbtxt")
        if folder.name == "set":
            assert json.loads(config_text.parameter(config, "fault_injection")) == json.loads(faults)
            assert config_text.parameter(config, "max_num_seqs") == "2"
            del config.parameters["fault_injection"]
            config.parameters["max_num_seqs"].string_value = "8"
        # the shipped relative model folder, read against the repository it came from, wherever the copy lies
        shipped_folder = config_text.parameter(shipped(model), "model")
        assert config_text.parameter(config, "model") == str(SHIPPED.parent / shipped_folder)
        config.parameters["model"].string_value = shipped_folder
        assert config == shipped(model)  # nothing else changed
        assert (folder / model / "1" / "model.py").is_file()


def test_the_dynamic_batchers_priority_levels_are_the_ones_the_priority_input_reads():
    """llm_dynamic's and llm_static's queues are ordered by Triton's priority with the levels that
    backend/contract/priority.py owns; every model's engine orders its own queue by the same input (an optional one,
    backend/contract/io_schema.py)."""
    for name in (DYNAMIC, STATIC):
        batcher = config_text.dynamic_batching(config_text.load(SHIPPED / name / "config.pbtxt"))
        assert (batcher.priority_levels, batcher.default_priority_level) == (PRIORITY_LEVELS, DEFAULT_PRIORITY_LEVEL)
    for name in MODELS:
        config = config_text.load(SHIPPED / name / "config.pbtxt")
        assert config_text.parameter(config, "scheduling_policy") == "priority"
    assert io_schema.BY_NAME["priority"].optional
