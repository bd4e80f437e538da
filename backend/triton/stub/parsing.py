"""Request parsing: a Triton request's input tensors and parameters -> prompt, ``SamplingParams``, stream, priority.

Plain Python on numpy arrays (``read_inputs`` receives ``triton_python_backend_utils`` as ``pb`` instead of importing
it), so it runs without a server. Every refusal is an ``InvalidRequest`` (a ``ValueError``, backend/contract/errors.py)
that names the input or setting to blame; its message goes to the client as it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from backend.contract import io_schema
from backend.contract.errors import PROMPT, ContextLengthExceeded, InvalidRequest
from backend.contract.priority import DEFAULT_PRIORITY_LEVEL, priority_level
from backend.contract.sampling_ranges import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from backend.engine.sampling_params import SamplingParams

# The inputs that are sampling settings; every input is declared in backend/contract/io_schema.py (anything else is
# refused by Triton itself).
SAMPLING_INPUTS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "n")
# Input names other Triton LLM backends use for a sampling setting (TensorRT-LLM's), sent as they are by their clients.
SAMPLING_INPUT_ALIASES = {"min_length": "min_tokens"}
# vllm_backend's switches for optional outputs. Ours are returned unless a request turns them off.
RETURN_INPUTS = {
    "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens",
    "return_finish_reason": "finish_reason",
}
# vllm_backend's switch for the ``logprobs`` output, off unless asked: on, each token's log-probability (and, with
# ``logprobs: k`` in sampling_parameters, the k likeliest tokens') comes with it.
RETURN_LOGPROBS = "return_logprobs"
ALL_INPUTS = io_schema.INPUT_NAMES
SAMPLING_KEYS = tuple(sorted(f.name for f in fields(SamplingParams)))
# A prompt is refused before tokenising when its UTF-8 bytes exceed this many per token of max_model_len
# (no tokenizer needs more), so a 10 MB text_input costs no tokenizer time and no memory spike.
MAX_PROMPT_BYTES_PER_TOKEN = 16
# sampling_parameters and the request parameters are small JSON objects; 16 stop strings of 256 characters,
# JSON-escaped, fit with room to spare.
MAX_PARAMETERS_BYTES = 64 * 1024


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of this model; every refusal names the limit it hit."""

    max_model_len: int

    @property
    def max_prompt_bytes(self) -> int:
        return MAX_PROMPT_BYTES_PER_TOKEN * self.max_model_len


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    omitted_outputs: frozenset[str] = frozenset()  # optional outputs the request turned off (return_*: false)
    requested_outputs: frozenset[str] = frozenset()  # asked for in every response, not just the final (return_*: true)
    # Triton's level (backend/contract/priority.py), from the optional ``priority`` input: the Python backend of
    # Triton 2.51 cannot read a request's own priority, which only Triton's dynamic batcher sees
    # (triton_workarounds.NO_REQUEST_PRIORITY).
    priority: int = DEFAULT_PRIORITY_LEVEL


def parse_request(inputs: dict[str, np.ndarray], limits: RequestLimits, parameters: str = "") -> ParsedRequest:
    """Validate one request: its input tensors (``name -> numpy array``, missing optional inputs absent) and its
    request parameters (a JSON object; Triton's HTTP /generate passes JSON fields that are not inputs there).

    Sampling settings are layered: input tensors, then request parameters, then the ``sampling_parameters`` JSON.
    Keys that are not sampling settings are refused wherever they appear.
    """
    if "text_input" not in inputs:
        raise InvalidRequest(PROMPT, "missing required input 'text_input'")
    texts = inputs["text_input"].reshape(-1)
    if texts.size != 1:
        raise InvalidRequest(PROMPT, f"text_input must hold exactly one prompt per request; got {texts.size}")
    raw = texts[0]
    if isinstance(raw, str):
        raw = raw.encode("utf-8")
    if len(raw) > limits.max_prompt_bytes:
        raise ContextLengthExceeded(
            PROMPT,
            f"text_input is {len(raw)} bytes; the limit is {limits.max_prompt_bytes} bytes "
            f"({MAX_PROMPT_BYTES_PER_TOKEN} per token of max_model_len {limits.max_model_len})"
        )
    try:
        prompt = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(PROMPT, f"text_input is not valid UTF-8 (byte {exc.start})") from None
    if not prompt:
        raise InvalidRequest(PROMPT, "text_input is empty")

    values: dict[str, Any] = {}  # a setting not sent takes SamplingParams' default
    for name in SAMPLING_INPUTS:
        if name in inputs:
            values[name] = _scalar(name, inputs[name])
    for alias, name in SAMPLING_INPUT_ALIASES.items():
        if alias in inputs:
            if name in inputs:
                raise InvalidRequest(alias, f"send either '{name}' or '{alias}' (the same setting), not both")
            values[name] = _scalar(alias, inputs[alias])
    if "stop" in inputs:
        values["stop"] = _stop_strings(inputs["stop"])
    values.update(_json_object(None, parameters))
    if "sampling_parameters" in inputs:
        text = _text("sampling_parameters", _scalar("sampling_parameters", inputs["sampling_parameters"]))
        values.update(_json_object("sampling_parameters", text))
    stream = bool(_scalar("stream", inputs["stream"])) if "stream" in inputs else False
    if RETURN_LOGPROBS in inputs and _scalar(RETURN_LOGPROBS, inputs[RETURN_LOGPROBS]):
        values["logprobs"] = values.get("logprobs") or 0
    params = SamplingParams.from_dict(values)
    switches = {out: bool(_scalar(name, inputs[name])) for name, out in RETURN_INPUTS.items() if name in inputs}
    if params.logprobs is not None:
        switches["logprobs"] = True
    omitted = frozenset(out for out, on in switches.items() if not on)
    requested = frozenset(out for out, on in switches.items() if on)
    if params.max_tokens is not None and params.max_tokens >= limits.max_model_len:
        raise ContextLengthExceeded(
            "max_tokens",
            f"max_tokens is {params.max_tokens}, beyond this model's max_model_len ({limits.max_model_len}): "
            f"prompt and output together must fit in max_model_len, so at most {limits.max_model_len - 1} tokens "
            "can be generated"
        )
    return ParsedRequest(prompt, params, stream, omitted, requested, _priority(inputs))


def _priority(inputs: dict[str, np.ndarray]) -> int:
    """The ``priority`` input as Triton's level (0 and levels beyond the last: the default one)."""
    if "priority" not in inputs:
        return DEFAULT_PRIORITY_LEVEL
    value = _scalar("priority", inputs["priority"])
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest("priority", f"priority must be an integer >= 0 (1 is the highest level, 0 the default "
                                         f"one); got {value!r}")
    return priority_level(value)


def _json_object(name: str | None, text: str) -> dict[str, Any]:
    """A JSON object of sampling settings (numbers may be strings, as genai-perf sends them): the input ``name``, or
    the request parameters (``name`` None)."""
    if not text:
        return {}
    source = name or "the request parameters"
    if len(text) > MAX_PARAMETERS_BYTES:
        raise InvalidRequest(name, f"{source} is {len(text)} characters; the limit is {MAX_PARAMETERS_BYTES}")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(name, f"{source} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(raw, dict):
        raise InvalidRequest(name, f"{source} must be a JSON object")
    unknown = sorted(set(raw) - set(SAMPLING_KEYS))
    if unknown:
        raise InvalidRequest(name, f"unknown key(s) in {source}: {', '.join(unknown)}; "
                                   f"known: {', '.join(SAMPLING_KEYS)}")
    return raw


def _stop_strings(array: np.ndarray) -> list[str]:
    flat = array.reshape(-1)
    if flat.size > MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed; got {flat.size}")
    for value in flat:  # refuse a huge one before decoding it (4 bytes per character at most)
        if isinstance(value, (bytes, np.bytes_)) and len(value) > 4 * MAX_STOP_STRING_CHARS:
            raise InvalidRequest("stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters; "
                                         f"got one of {len(value)} bytes")
    return [_text("stop", s) for s in flat]


def _scalar(name: str, array: np.ndarray) -> Any:
    flat = array.reshape(-1)
    if flat.size != 1:
        raise InvalidRequest(name, f"input '{name}' must hold one value; got {flat.size}")
    value = flat[0]
    if isinstance(value, np.floating) and not np.isfinite(value):
        raise InvalidRequest(name, f"input '{name}' must be a finite number; got {value}")
    return value.item() if isinstance(value, np.generic) and not isinstance(value, np.bytes_) else value


def _text(name: str, value: Any) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(name, f"input '{name}' is not valid UTF-8") from None
    return str(value)


def read_inputs(pb, request) -> dict[str, np.ndarray]:
    """The request's input tensors by name; optional inputs that were not sent are absent.

    Element counts are checked on the shape, before a tensor becomes numpy objects (a ``stop`` input may have
    any length in config.pbtxt; a million stop strings must not become a million Python objects).
    """
    inputs = {}
    for name in ALL_INPUTS:
        tensor = pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            continue
        count = int(np.prod(tensor.shape()))
        limit = MAX_STOP_STRINGS if name == "stop" else 1
        if count > limit:
            what = f"at most {MAX_STOP_STRINGS} stop strings are allowed" if name == "stop" else \
                f"input '{name}' must hold one value per request"
            raise InvalidRequest(name, f"{what}; got {count}")
        inputs[name] = tensor.as_numpy()
    return inputs


def read_parameters(request) -> str:
    """The request parameters as a JSON object string ("" when none were sent)."""
    text = request.parameters()
    return "" if text in ("", "{}") else text
