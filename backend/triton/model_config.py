"""The engine's settings from a Triton model config (config.pbtxt, as JSON), and the checks ``initialize()`` makes."""

from __future__ import annotations

import os
from pathlib import Path

from backend.engine.config import EngineConfig
from backend.triton.faults import FAULTS_PARAMETER


def engine_config_from_triton(model_config: dict, model_dir: str) -> EngineConfig:
    """EngineConfig from the ``parameters`` block of config.pbtxt.

    A relative ``model`` path is resolved against the folder that holds the model repository; the environment
    variable ``LLM_MODEL`` overrides it (``make serve MODEL=...``, the Docker image).
    """
    params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
    params.pop(FAULTS_PARAMETER, None)  # not an engine setting: see FaultInjector
    model = os.environ.get("LLM_MODEL") or params.get("model", "")
    if not model:
        raise ValueError("no model folder: set the 'model' parameter in config.pbtxt or the LLM_MODEL variable")
    path = Path(model).expanduser()
    if not path.is_absolute():
        path = Path(model_dir).resolve().parent.parent / path
    params["model"] = str(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {path} has no config.json; prepare it with `make model` or set LLM_MODEL")
    return EngineConfig.from_dict(params)


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
