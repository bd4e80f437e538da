"""What goes over the wire and what comes back: the request, its input tensors, response chunks, the result.

Names and types are the models' I/O schema (backend/contract/io_schema.py), shared by every model the server loads.
Nothing here talks to a server.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tritonclient.grpc as grpcclient

from backend.contract import io_schema

# The numpy type each wire datatype is built from.
_NUMPY = {"BYTES": np.object_, "INT32": np.int32, "UINT32": np.uint32, "UINT64": np.uint64, "FP32": np.float32,
          "BOOL": np.bool_}


@dataclass
class GenerationRequest:
    """One generation request, named as the models' inputs; ``None`` leaves an input out (model default)."""

    text_input: str
    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    ignore_eos: bool | None = None
    n: int | None = None  # answers of the prompt; each response then carries its ``index``
    stream: bool = True
    sampling_parameters: Mapping[str, Any] | None = None
    exclude_input_in_output: bool | None = None
    return_logprobs: bool | None = None  # the logprobs output (sampling_parameters' logprobs: k adds the top k)
    return_num_input_tokens: bool | None = None  # true: the counts in every response, not just the final one
    return_num_output_tokens: bool | None = None
    # Triton's level (1 the highest, 0 or None the default one: backend/contract/priority.py). Sent twice: as the
    # request's own Triton priority, which orders the dynamic batcher's queue, and as the ``priority`` input, which
    # the engine reads (a Python model cannot read the first in Triton 2.51: triton_workarounds.NO_REQUEST_PRIORITY).
    priority: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text_input, str):
            raise ValueError(f"text_input must be a str, not {type(self.text_input).__name__}")
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def input_values(self) -> dict[str, list]:
        """The inputs to send, each as a flat list of values (``stop`` may hold several; the others hold one)."""
        values: dict[str, list] = {}
        for name in INPUT_TYPES:
            value = getattr(self, name)
            if value is None or (name == "stop" and not value):
                continue
            if name == "sampling_parameters":
                value = json.dumps(dict(value))
            values[name] = list(value) if name == "stop" else [value]
        return values



# Input name -> (Triton datatype, numpy dtype) for the inputs this client sends (GenerationRequest's fields), as every
# model declares them (backend/contract/io_schema.py).
INPUT_TYPES: dict[str, tuple[str, Any]] = {
    f.name: (io_schema.BY_NAME[f.name].wire_type, _NUMPY[io_schema.BY_NAME[f.name].wire_type])
    for f in fields(GenerationRequest)
}

@dataclass(frozen=True)
class Chunk:
    """One response of a generation: the new text and token ids, and when it arrived."""

    text: str
    output_ids: tuple[int, ...]
    finish_reason: str | None  # "stop", "length" or "abort" on the last response; None before
    num_input_tokens: int | None
    num_output_tokens: int | None  # generated so far, as the server counts
    time_s: float  # seconds since the request was sent

    @property
    def num_tokens(self) -> int:
        """Tokens this response carries (a response with text but no ids counts as one)."""
        return len(self.output_ids) or (1 if self.text else 0)


@dataclass
class GenerationResult:
    """A finished generation with its client-side timings (seconds, ``time.perf_counter``).

    ``ttft_s``: request sent -> first response carrying a token. ``itl_s``: gaps between successive responses that
    carry tokens. ``tpot_s``: time per output token after the first response, i.e. the mean of ``itl_s`` when each
    response carries one token (``None`` when every token came in the first response). ``e2e_s``: request sent ->
    final response.
    """

    text: str
    output_ids: list[int]
    finish_reason: str | None
    num_input_tokens: int | None
    num_output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    itl_s: list[float] = field(default_factory=list)
    num_responses: int = 0
    cancelled: bool = False

    @classmethod
    def from_chunks(cls, chunks: Sequence[Chunk], e2e_s: float, cancelled: bool = False) -> "GenerationResult":
        """Assemble the text and timings of a generation from its chunks, in arrival order."""
        token_chunks = [c for c in chunks if c.num_tokens]
        times = [c.time_s for c in token_chunks]
        num_tokens = sum(c.num_tokens for c in token_chunks)
        num_after_first = num_tokens - (token_chunks[0].num_tokens if token_chunks else 0)
        counted = [c.num_output_tokens for c in chunks if c.num_output_tokens is not None]
        inputs = [c.num_input_tokens for c in chunks if c.num_input_tokens is not None]
        reasons = [c.finish_reason for c in chunks if c.finish_reason]
        return cls(
            text="".join(c.text for c in chunks),
            output_ids=[i for c in chunks for i in c.output_ids],
            finish_reason=reasons[-1] if reasons else None,
            num_input_tokens=inputs[-1] if inputs else None,
            num_output_tokens=counted[-1] if counted else num_tokens,
            ttft_s=times[0] if times else None,
            tpot_s=(times[-1] - times[0]) / num_after_first if num_after_first > 0 else None,
            e2e_s=e2e_s,
            itl_s=[b - a for a, b in zip(times, times[1:])],
            num_responses=len(chunks),
            cancelled=cancelled,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ModelInfo:
    """A model in the server's repository index, with its batching mode read from its config."""

    name: str
    version: str
    state: str
    reason: str = ""
    batching: str = ""

    @property
    def is_ready(self) -> bool:
        return self.state == "READY"


def describe_batching(config: Mapping[str, Any]) -> str:
    """Who forms the batch, from a model config (HTTP or gRPC JSON form)."""
    max_batch_size = int(config.get("max_batch_size", 0))
    decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
    policy = config.get("parameters", {}).get("batching", {}).get("string_value")
    if "dynamic_batching" in config:
        # NOTE: not preferred_batch_size: Triton's auto-complete fills it in (= max_batch_size) for every batcher.
        delay_us = int(config["dynamic_batching"].get("max_queue_delay_microseconds", 0))
        return f"dynamic batcher (max_batch_size {max_batch_size}, max_queue_delay {delay_us} µs)"
    if config.get("sequence_batching", {}).get("iterative_sequence"):
        mode = "decoupled, " if decoupled else ""
        return f"{mode}Triton's iterative sequence batcher (max_batch_size {max_batch_size})"
    if policy:
        return f"{'decoupled, ' if decoupled else ''}engine-side {policy} batching"
    return f"no batching (max_batch_size {max_batch_size})"


def build_inputs(request: GenerationRequest, max_batch_size: int) -> list[grpcclient.InferInput]:
    """The gRPC inputs for ``request``: shape ``[n]``, or ``[1, n]`` for a model with ``max_batch_size > 0``."""
    return input_tensors(request.input_values(), max_batch_size)


def raw_input_values(text_input: str | bytes | None, **values: Any) -> dict[str, list]:
    """Input values as given, unchecked (a test's bad request too): ``text_input`` left out when None, ``stop`` a
    list of strings, every other input one value."""
    found: dict[str, list] = {} if text_input is None else {"text_input": [text_input]}
    for name, value in values.items():
        found[name] = list(value) if name == "stop" else [value]
    return found


def input_tensors(values: Mapping[str, Sequence[Any]], max_batch_size: int) -> list[grpcclient.InferInput]:
    """gRPC input tensors of the types ``INPUT_TYPES`` gives, from each input's values (``str`` sent as UTF-8,
    ``bytes`` as they are): shape ``[n]``, or ``[1, n]`` for a model with ``max_batch_size > 0``."""
    batch_dims = (1,) if max_batch_size > 0 else ()
    inputs = []
    for name, values_of_input in values.items():
        datatype, dtype = INPUT_TYPES[name]
        if dtype is np.object_:
            values_of_input = [v.encode("utf-8") if isinstance(v, str) else v for v in values_of_input]
        array = np.array(values_of_input, dtype=dtype).reshape(batch_dims + (len(values_of_input),))
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def flat_values(value: Any) -> list:
    """HTTP JSON carries a one-element output as a plain value and others as (possibly nested) lists."""
    if value is None:
        return []
    if isinstance(value, (list, tuple, np.ndarray)):
        return [x for item in value for x in flat_values(item)]
    return [value]


def parse_chunk(get: Callable[[str], Any], time_s: float) -> Chunk:
    """A Chunk from one response; ``get(name)`` returns an output's values (None when absent).

    Over gRPC ``get`` is ``InferResult.as_numpy``; over HTTP it is the answer's ``dict.get``.
    """

    def first(name: str) -> Any:
        values = flat_values(get(name))
        return values[0] if values else None

    def text(value: Any) -> str:
        return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else (value or "")

    num_input, num_output = first("num_input_tokens"), first("num_output_tokens")
    return Chunk(
        text="".join(text(v) for v in flat_values(get("text_output"))),
        output_ids=tuple(int(i) for i in flat_values(get("output_ids"))),
        finish_reason=text(first("finish_reason")) or None,
        num_input_tokens=None if num_input is None else int(num_input),
        num_output_tokens=None if num_output is None else int(num_output),
        time_s=time_s,
    )
