"""config.pbtxt as a ``ModelConfig`` message: the one reader and writer of a model's config text, for whatever
serves a changed copy of model_repository/ (the launcher's ``copy_model_repository``, ``make bench``'s served column,
the load tests' variants and capacity copies, the test harness).

The text is protobuf's text format of Triton's ``model_config.proto`` (the ``ModelConfig`` that tritonclient ships),
so a setting is a field, not a line to find: a config that spells it another way (another layout, a comment) cannot
make an edit miss, and a batcher the config does not have is refused, not silently added. A written copy loses the
comments; the repository's own files are only ever read.

NOTE: not for code that runs inside Triton's Python stub (a ``model.py`` and what it imports): the server hands a
model its config as JSON (``args["model_config"]``, read by ``stub/model_config.py``), and the stub's environment need
not have tritonclient.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from google.protobuf import text_format
from tritonclient.grpc.model_config_pb2 import ModelConfig, ModelDynamicBatching, ModelSequenceBatching

__all__ = ["ModelConfig", "dynamic_batching", "edit", "load", "oldest_sequence_batching", "parameter", "save",
           "sequence_batching", "set_instance_count", "set_max_batch_size", "set_parameters"]


def load(path: str | os.PathLike) -> ModelConfig:
    """The model config in ``path``; ``ValueError`` naming the file and the line when Triton could not read it."""
    try:
        with open(path) as file:
            return text_format.Parse(file.read(), ModelConfig())
    except text_format.ParseError as exc:
        raise ValueError(f"{path}: not a Triton model config: {exc}") from None


def save(config: ModelConfig, path: str | os.PathLike) -> None:
    with open(path, "w") as file:
        file.write(text_format.MessageToString(config))


@contextlib.contextmanager
def edit(path: str | os.PathLike) -> Iterator[ModelConfig]:
    """``with edit(path) as config:`` change ``config``; it is written back when the block ends without an error."""
    config = load(path)
    yield config
    save(config, path)


# ---- the engine's settings: string parameters -------------------------------------------------------------------


def parameter(config: ModelConfig, key: str) -> str | None:
    """The string parameter ``key``; None when the config does not set it."""
    # NOTE: `in` first: reading a missing key of a message map adds it.
    return config.parameters[key].string_value if key in config.parameters else None


def set_parameters(config: ModelConfig, parameters: Mapping[str, object], add_missing: bool = True) -> None:
    """Set each string parameter to ``str(value)``: replaced where the config has the key, added where it has not;
    with ``add_missing=False`` a key the config lacks is refused (a shipped parameter that disappeared would
    otherwise go unnoticed)."""
    missing = [key for key in parameters if key not in config.parameters]
    if missing and not add_missing:
        raise ValueError(f"{config.name}'s config has no parameter {', '.join(map(repr, missing))} to set")
    for key, value in parameters.items():
        config.parameters[key].string_value = str(value)


# ---- Triton's settings: the batch, the batchers, the instances ----------------------------------------------------


def set_max_batch_size(config: ModelConfig, max_batch_size: int) -> None:
    """Triton's largest batch; refused for a model that Triton does not batch (``max_batch_size: 0``: its inputs
    have no batch dimension, so a batch size would change what every client sends)."""
    if config.max_batch_size == 0:
        raise ValueError(f"{config.name} is not batched by Triton (max_batch_size 0); its batch size cannot be set")
    if max_batch_size < 1:
        raise ValueError(f"{config.name}: max_batch_size must be at least 1, not {max_batch_size}")
    config.max_batch_size = max_batch_size


def dynamic_batching(config: ModelConfig) -> ModelDynamicBatching:
    """The config's dynamic batcher, to set its fields; ``ValueError`` when it has none (a field set on a missing
    batcher would add one)."""
    if config.WhichOneof("scheduling_choice") != "dynamic_batching":
        raise ValueError(f"{config.name}'s config has no dynamic_batching")
    return config.dynamic_batching


def sequence_batching(config: ModelConfig) -> ModelSequenceBatching:
    """The config's sequence batcher, to set its fields; ``ValueError`` when it has none."""
    if config.WhichOneof("scheduling_choice") != "sequence_batching":
        raise ValueError(f"{config.name}'s config has no sequence_batching")
    return config.sequence_batching


def oldest_sequence_batching(config: ModelConfig) -> ModelSequenceBatching.StrategyOldest:
    """The ``oldest`` strategy of the config's sequence batcher, to set its fields (``max_candidate_sequences``: the
    sequences batched at once); ``ValueError`` when the batcher is missing or has another strategy."""
    batcher = sequence_batching(config)
    if batcher.WhichOneof("strategy_choice") != "oldest":
        raise ValueError(f"{config.name}'s sequence_batching has no 'oldest' strategy")
    return batcher.oldest


def set_instance_count(config: ModelConfig, count: int) -> None:
    """The number of model instances, in a config with one ``instance_group``."""
    if len(config.instance_group) != 1:
        raise ValueError(f"{config.name}'s config has {len(config.instance_group)} instance groups; expected one")
    if count < 1:
        raise ValueError(f"{config.name}: the instance count must be at least 1, not {count}")
    config.instance_group[0].count = count
