"""The engine's settings from a Triton model config (config.pbtxt, as JSON), what the model adds to that config when
Triton loads it (``complete_config``), and the checks ``initialize()`` makes."""

from __future__ import annotations

import os
from pathlib import Path

from backend.contract import io_schema
from backend.contract.priority import DEFAULT_PRIORITY_LEVEL, PRIORITY_LEVELS
from backend.contract.settings import MODEL_ENV_VAR
from backend.engine.config import EngineConfig
from backend.triton.stub.faults import FAULTS_PARAMETER
from backend.triton.stub.stream_interval import STREAM_INTERVAL, STREAM_INTERVAL_MS, StreamInterval


def engine_config_from_triton(model_config: dict, model_dir: str) -> EngineConfig:
    """EngineConfig from the ``parameters`` block of config.pbtxt.

    A relative ``model`` path is resolved against the folder that holds the model repository; the environment
    variable ``LLM_MODEL`` overrides it (``make serve MODEL=...``, the Docker image).
    """
    params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
    for name in (FAULTS_PARAMETER, STREAM_INTERVAL, STREAM_INTERVAL_MS):  # not engine settings: the server's
        params.pop(name, None)
    model = os.environ.get(MODEL_ENV_VAR) or params.get("model", "")
    if not model:
        raise ValueError("no model folder: set the 'model' parameter in config.pbtxt or the LLM_MODEL variable")
    path = Path(model).expanduser()
    if not path.is_absolute():
        path = Path(model_dir).resolve().parent.parent / path
    params["model"] = str(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {path} has no config.json; prepare it with `make model` or set LLM_MODEL")
    return EngineConfig.from_dict(params)


def complete_config(model_config, model_dir: str):
    """What a model adds to its config when Triton loads it (``auto_complete_config``; ``model_config`` is
    ``pb_utils.ModelConfig`` or a stand-in with its ``add_input``, ``add_output`` and ``as_dict``): the inputs and
    outputs every model serves (backend/contract/io_schema.py; one that config.pbtxt declares too must agree with
    it, or Triton refuses to load the model), and the ``max_model_len`` its engine will run with, resolved against the
    model folder now, for the frontend to read from Triton. Returns ``model_config``."""
    for tensor in io_schema.INPUTS:
        model_config.add_input(tensor.as_input())
    for tensor in io_schema.OUTPUTS:
        model_config.add_output(tensor.as_output())
    config = model_config.as_dict()
    resolved = engine_config_from_triton(config, model_dir).resolve().max_model_len
    # NOTE: the same value the engine resolves in initialize(): set explicitly, it resolves to itself.
    config.setdefault("parameters", {})[io_schema.MAX_MODEL_LEN_PARAMETER] = {"string_value": str(resolved)}
    return model_config


def stream_interval_from_triton(model_config: dict) -> StreamInterval:
    """How often streams are sent (``stream_interval``, ``stream_interval_ms``: ``stream_interval.py``)."""
    params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
    return StreamInterval.from_parameters(params)


def model_is_decoupled(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def check_model(model_name: str, model_config: dict, config: EngineConfig, batching: str) -> None:
    """What every model checks in ``initialize()``: it streams tokens, so it must be decoupled, and its engine must
    batch the way its ``model.py`` drives it (``batching``). Raises ``ValueError`` with the line to fix."""
    if not model_is_decoupled(model_config):
        raise ValueError(
            f"{model_name} streams tokens and must be decoupled: "
            "set model_transaction_policy { decoupled: true } in config.pbtxt"
        )
    if config.batching != batching:
        raise ValueError(
            f"{model_name} drives its engine as '{batching}' batching, but config.pbtxt sets batching to "
            f"'{config.batching}': set parameters: {{ key: \"batching\", value: {{ string_value: \"{batching}\" }} }}"
        )


def check_batcher(model_name: str, model_config: dict, config: EngineConfig) -> None:
    """What the engine's way of batching needs of Triton's batcher, so that every request Triton hands over can run:
    a run-to-completion batch runs whole (``max_num_seqs >= max_batch_size``), and iterative batching needs Triton's
    iterative sequence batcher with no more candidate sequences than ``max_num_seqs``, unless the engine orders its
    queue by priority (``scheduling_policy: priority``): then the candidates beyond the seats wait in the engine's
    queue, where a higher level goes first (Triton's own backlog has no priority levels). A dynamic batcher with
    priority levels must read them as the ``priority`` input does (backend/contract/priority.py). Raises
    ``ValueError``."""
    max_batch_size = int(model_config.get("max_batch_size", 0))
    if config.batching == "run_to_completion" and config.max_num_seqs < max_batch_size:
        raise ValueError(f"{model_name}: max_num_seqs ({config.max_num_seqs}) must be >= max_batch_size "
                         f"({max_batch_size}) so a whole batch runs together")
    if config.batching == "iterative":
        sequencing = model_config.get("sequence_batching", {})
        if not sequencing.get("iterative_sequence"):
            raise ValueError(f"{model_name} needs sequence_batching {{ iterative_sequence: true }}")
        seats = int(sequencing.get("oldest", {}).get("max_candidate_sequences", 0))
        waits_by_priority = config.scheduling_policy == "priority"
        if seats <= 0 or (not waits_by_priority and (seats > config.max_num_seqs
                                                      or max_batch_size > config.max_num_seqs)):
            raise ValueError(f"{model_name}: max_num_seqs ({config.max_num_seqs}) must be >= max_batch_size and >= "
                             "oldest { max_candidate_sequences } so that every request Triton hands over can run "
                             "(or set scheduling_policy to priority: those beyond the seats then wait in the engine)")
    levels = model_config.get("dynamic_batching", {})
    if int(levels.get("priority_levels", 0)) and (int(levels["priority_levels"]), int(
            levels.get("default_priority_level", 0))) != (PRIORITY_LEVELS, DEFAULT_PRIORITY_LEVEL):
        raise ValueError(f"{model_name}: dynamic_batching has priority_levels {levels['priority_levels']} and "
                         f"default_priority_level {levels.get('default_priority_level', 0)}; the priority input "
                         f"reads {PRIORITY_LEVELS} levels with {DEFAULT_PRIORITY_LEVEL} the default: set those")


def sequence_idle_seconds(model_config: dict) -> float:
    """How long Triton's sequence batcher keeps a sequence it was not handed back (max_sequence_idle_microseconds)."""
    return int(model_config.get("sequence_batching", {}).get("max_sequence_idle_microseconds", 5_000_000)) / 1e6
