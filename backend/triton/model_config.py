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
