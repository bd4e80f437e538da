"""The models' inputs and outputs, declared once: every model serves the same schema (model_repository/README.md).

Each model adds them to its config when Triton loads it (``ServedModel.auto_complete_config``, as Triton's vLLM
backend does), so a ``config.pbtxt`` holds only what an operator tunes: batcher, instances, engine parameters. The
stub's parsing and responses, the client's request builder (and through it the OpenAI frontend) read the names and
types from here; ``tests/unit/test_io_schema.py`` checks model_repository/README.md's tables against it.

Names follow Triton's vLLM and TensorRT-LLM backends, so their clients, genai-perf and Triton's HTTP ``/generate``
work unchanged. On a model with ``max_batch_size`` > 0 every shape gains the batch dimension in front.

``max_model_len`` travels the same way: the model writes the value its engine resolves into its config's
``parameters`` when it loads (set or not in ``config.pbtxt``), and the frontend reads it from Triton's model config
(:func:`served_max_model_len`) instead of resolving it again.

Standard library only (the contract's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

# Triton's config data types -> the datatypes its clients name on the wire
WIRE_TYPES = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_UINT32": "UINT32", "TYPE_UINT64": "UINT64",
              "TYPE_FP32": "FP32", "TYPE_BOOL": "BOOL"}
MAX_MODEL_LEN_PARAMETER = "max_model_len"


@dataclass(frozen=True)
class Tensor:
    """One input or output as Triton's model config declares it (``dims`` without the batch dimension)."""

    name: str
    data_type: str  # Triton's config type: TYPE_STRING, TYPE_INT32, ...
    dims: tuple[int, ...] = (1,)
    optional: bool = True  # inputs only: outputs are never required in a response

    def __post_init__(self) -> None:
        if self.data_type not in WIRE_TYPES:
            raise ValueError(f"{self.name}: data type {self.data_type} is not one of {sorted(WIRE_TYPES)}")

    @property
    def wire_type(self) -> str:
        """The datatype clients send or read it as ("BYTES", "INT32", ...)."""
        return WIRE_TYPES[self.data_type]

    def as_input(self) -> dict:
        """The entry of a model config's ``input`` list (what ``auto_complete_config`` adds)."""
        return {"name": self.name, "data_type": self.data_type, "dims": list(self.dims), "optional": self.optional}

    def as_output(self) -> dict:
        return {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}


def _flag(name: str) -> Tensor:
    return Tensor(name, "TYPE_BOOL")


INPUTS: tuple[Tensor, ...] = (
    Tensor("text_input", "TYPE_STRING", optional=False),
    Tensor("max_tokens", "TYPE_INT32"),
    Tensor("min_tokens", "TYPE_INT32"),
    Tensor("min_length", "TYPE_INT32"),  # TensorRT-LLM's name for min_tokens
    Tensor("temperature", "TYPE_FP32"),
    Tensor("top_p", "TYPE_FP32"),
    Tensor("top_k", "TYPE_INT32"),
    Tensor("seed", "TYPE_UINT64"),  # TensorRT-LLM's type; vLLM's clients send the seed in sampling_parameters
    Tensor("stop", "TYPE_STRING", (-1,)),
    _flag("ignore_eos"),
    _flag("stream"),
    Tensor("sampling_parameters", "TYPE_STRING"),  # JSON: vLLM's SamplingParams, as vllm_backend takes them
    Tensor("n", "TYPE_INT32"),
    _flag("exclude_input_in_output"),
    _flag("return_num_input_tokens"),
    _flag("return_num_output_tokens"),
    _flag("return_finish_reason"),
    _flag("return_logprobs"),
    # Triton's level (1 is the highest, 0 the default one: backend/contract/priority.py), for the engine's scheduler
    # and the metrics: the Python backend cannot read a request's own priority (triton_workarounds.NO_REQUEST_PRIORITY).
    Tensor("priority", "TYPE_UINT32"),
)

OUTPUTS: tuple[Tensor, ...] = (
    Tensor("text_output", "TYPE_STRING"),
    Tensor("output_ids", "TYPE_INT32", (-1,)),
    Tensor("index", "TYPE_INT32"),
    Tensor("finish_reason", "TYPE_STRING"),
    Tensor("num_input_tokens", "TYPE_INT32"),
    Tensor("num_output_tokens", "TYPE_INT32"),
    Tensor("logprobs", "TYPE_STRING"),
    Tensor("prompt_logprobs", "TYPE_STRING"),  # vLLM's prompt_logprobs, in logprobs' JSON: once, when asked
)

INPUT_NAMES = tuple(t.name for t in INPUTS)
OUTPUT_NAMES = tuple(t.name for t in OUTPUTS)
BY_NAME = {t.name: t for t in (*INPUTS, *OUTPUTS)}


def served_max_model_len(model_config: dict) -> int | None:
    """The ``max_model_len`` a loaded model's engine runs with, from its config as Triton serves it (JSON: the
    ``parameters`` block, which the model completed when it loaded); None for a model that does not publish one."""
    value = model_config.get("parameters", {}).get(MAX_MODEL_LEN_PARAMETER, {}).get("string_value", "")
    return int(value) if value.isdigit() else None
