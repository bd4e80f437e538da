"""What the two Triton models share: request parsing, engine settings from config.pbtxt, responses, metrics.

This is the one module that speaks Triton's Python-backend API. It receives ``triton_python_backend_utils`` as an
argument (``pb``) instead of importing it, so the rest of ``backend/`` and its tests run without a server.
Request parsing itself is plain Python on numpy arrays and raises ``ValueError`` with a message for the client.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backend.config import EngineConfig, SamplingParams
from backend.engine import RequestOutput

# Inputs both models declare (model_repository/README.md). Anything else is refused by Triton itself.
SAMPLING_INPUTS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")
ALL_INPUTS = ("text_input", *SAMPLING_INPUTS, "stop", "stream", "sampling_parameters", "exclude_input_in_output")
DEFAULT_MAX_TOKENS = 16
# A prompt is refused before tokenising when its UTF-8 bytes exceed this many per token of max_model_len
# (no tokenizer needs more), so a 10 MB text_input costs no tokenizer time and no memory spike.
MAX_PROMPT_BYTES_PER_TOKEN = 16


# ---- engine settings ----------------------------------------------------------------------------------------


def engine_config_from_triton(model_config: dict, model_dir: str) -> EngineConfig:
    """EngineConfig from the ``parameters`` block of config.pbtxt.

    A relative ``model`` path is resolved against the folder that holds the model repository; the environment
    variable ``LLM_MODEL`` overrides it (``make serve MODEL=...``, the Docker image).
    """
    params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
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


# ---- requests -----------------------------------------------------------------------------------------------


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool


def parse_request(inputs: dict[str, np.ndarray], max_prompt_bytes: int) -> ParsedRequest:
    """Validate one request's input tensors (``name -> numpy array``, missing optional inputs absent)."""
    if "text_input" not in inputs:
        raise ValueError("missing required input 'text_input'")
    texts = inputs["text_input"].reshape(-1)
    if texts.size != 1:
        raise ValueError(f"text_input must hold exactly one prompt per request; got {texts.size}")
    raw = texts[0]
    if isinstance(raw, str):
        raw = raw.encode("utf-8")
    if len(raw) > max_prompt_bytes:
        raise ValueError(f"text_input is {len(raw)} bytes; the limit is {max_prompt_bytes} bytes for this model")
    try:
        prompt = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"text_input is not valid UTF-8 (byte {exc.start})") from None
    if not prompt:
        raise ValueError("text_input is empty")

    values: dict[str, Any] = {"max_tokens": DEFAULT_MAX_TOKENS}
    for name in SAMPLING_INPUTS:
        if name in inputs:
            values[name] = _scalar(name, inputs[name])
    if "stop" in inputs:
        values["stop"] = [_text("stop", s) for s in inputs["stop"].reshape(-1)]
    params_json = _text("sampling_parameters", _scalar("sampling_parameters", inputs["sampling_parameters"])) \
        if "sampling_parameters" in inputs else ""
    stream = bool(_scalar("stream", inputs["stream"])) if "stream" in inputs else False
    params = SamplingParams.from_json(params_json, base=values)
    return ParsedRequest(prompt, params, stream)


def _scalar(name: str, array: np.ndarray) -> Any:
    flat = array.reshape(-1)
    if flat.size != 1:
        raise ValueError(f"input '{name}' must hold one value; got {flat.size}")
    value = flat[0]
    if isinstance(value, np.floating) and not np.isfinite(value):
        raise ValueError(f"input '{name}' must be a finite number; got {value}")
    return value.item() if isinstance(value, np.generic) and not isinstance(value, np.bytes_) else value


def _text(name: str, value: Any) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"input '{name}' is not valid UTF-8") from None
    return str(value)


def read_inputs(pb, request) -> dict[str, np.ndarray]:
    """The request's input tensors by name; optional inputs that were not sent are absent."""
    inputs = {}
    for name in ALL_INPUTS:
        tensor = pb.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return inputs


# ---- responses ----------------------------------------------------------------------------------------------


@dataclass
class OpenRequest:
    """A request the server has accepted and not yet answered finally. Used only by the thread that sends."""

    sender: Any
    stream: bool
    arrival: float = field(default_factory=time.perf_counter)
    text: list[str] = field(default_factory=list)  # non-streaming: the whole text, sent at the end
    token_ids: list[int] = field(default_factory=list)


def send_output(pb, open_request: OpenRequest, output: RequestOutput, batched: bool) -> None:
    """Send what one engine output means for this request: a delta (streaming), or the whole text at the end."""
    flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if output.finished else 0
    if output.error is not None:
        open_request.sender.send(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(output.error)), flags=flags)
        return
    if open_request.stream:
        text, token_ids = output.text, output.token_ids
    else:
        open_request.text.append(output.text)
        open_request.token_ids += output.token_ids
        if not output.finished:
            return
        text, token_ids = "".join(open_request.text), open_request.token_ids
    tensors = make_output_tensors(pb, text, token_ids, output, batched)
    open_request.sender.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)


def make_output_tensors(pb, text: str, token_ids: list[int], output: RequestOutput, batched: bool) -> list:
    lead = (1,) if batched else ()  # a model with max_batch_size > 0 answers with a batch dimension
    reason = output.finish_reason if output.finished else ""
    return [
        pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_).reshape(lead + (1,))),
        pb.Tensor("output_ids", np.array(token_ids, dtype=np.int32).reshape(lead + (-1,))),
        pb.Tensor("finish_reason", np.array([(reason or "").encode()], dtype=np.object_).reshape(lead + (1,))),
        pb.Tensor("num_input_tokens", np.array([output.num_prompt_tokens], dtype=np.int32).reshape(lead + (1,))),
        pb.Tensor("num_output_tokens", np.array([output.num_output_tokens], dtype=np.int32).reshape(lead + (1,))),
    ]


def send_error(pb, sender, message: str) -> None:
    sender.send(
        pb.InferenceResponse(output_tensors=[], error=pb.TritonError(message)),
        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    )


# ---- metrics ------------------------------------------------------------------------------------------------

_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
_BATCH_BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256]


class TritonMetrics:
    """Custom metrics on Triton's metrics port, labelled by model. Updated from the one thread that runs the engine.

    NOTE: each MetricFamily must stay referenced while its metrics are used (Triton deletes it otherwise).
    """

    def __init__(self, pb, model_name: str, num_kv_blocks: int) -> None:
        F = pb.MetricFamily
        labels = {"model": model_name}
        self._labels = labels

        def family(name: str, doc: str, kind) -> Any:
            fam = F(name=name, description=doc, kind=kind)
            self._families.append(fam)
            return fam

        self._families: list = []
        self._finished = family("llm_request_success_total", "Requests finished, by finish_reason", F.COUNTER)
        self._finished_by_reason: dict[str, Any] = {}
        self.prompt_tokens = family("llm_prompt_tokens_total", "Prompt tokens processed", F.COUNTER).Metric(labels)
        self.generation_tokens = family("llm_generation_tokens_total", "Tokens generated", F.COUNTER).Metric(labels)
        self.preemptions = family("llm_preemptions_total", "Sequences preempted (recompute)", F.COUNTER).Metric(labels)
        self.running = family("llm_num_requests_running", "Sequences in the running batch", F.GAUGE).Metric(labels)
        self.waiting = family("llm_num_requests_waiting", "Requests waiting to be scheduled", F.GAUGE).Metric(labels)
        self.kv_used = family("llm_kv_blocks_used", "KV-cache blocks in use", F.GAUGE).Metric(labels)
        self.kv_total = family("llm_kv_blocks_total", "KV-cache blocks in the pool", F.GAUGE).Metric(labels)
        self.kv_total.set(num_kv_blocks)

        def histogram(name: str, doc: str, buckets: list) -> Any:
            return family(name, doc, F.HISTOGRAM).Metric(labels, buckets=buckets)

        self.ttft = histogram("llm_time_to_first_token_seconds", "Time to first token (server side)", _LATENCY_BUCKETS)
        self.tpot = histogram("llm_time_per_output_token_seconds", "Mean time per output token after the first",
                              _LATENCY_BUCKETS)
        self.e2e = histogram("llm_e2e_request_latency_seconds", "Request latency (server side)", _LATENCY_BUCKETS)
        self.queue = histogram("llm_queue_time_seconds", "Time from arrival to first scheduling", _LATENCY_BUCKETS)
        self.batch_size = histogram("llm_batch_size", "Sequences in each forward step", _BATCH_BUCKETS)
        self._num_steps_seen = 0

    def on_finished(self, output: RequestOutput, arrival: float) -> None:
        reason = output.finish_reason or "error"
        counter = self._finished_by_reason.get(reason)
        if counter is None:
            counter = self._finished_by_reason[reason] = self._finished.Metric({**self._labels, "finish_reason": reason})
        counter.increment(1)
        self.prompt_tokens.increment(output.num_prompt_tokens)
        self.generation_tokens.increment(output.num_output_tokens)
        t = output.timings
        if t is None or t.finished is None:
            return
        self.e2e.observe(t.finished - arrival)
        if t.first_scheduled is not None:
            self.queue.observe(max(t.first_scheduled - arrival, 0.0))
        if t.first_token is not None:
            self.ttft.observe(t.first_token - arrival)
            if output.num_output_tokens > 1:
                self.tpot.observe((t.finished - t.first_token) / (output.num_output_tokens - 1))

    def on_steps(self, engine) -> None:
        """Observe the engine steps recorded since the last call, and refresh the gauges."""
        stats = engine.stats
        new = stats.num_steps - self._num_steps_seen
        if new > 0:
            for record in list(stats.steps)[-min(new, len(stats.steps)):]:
                self.batch_size.observe(record.num_seqs)
                if record.num_preempted:
                    self.preemptions.increment(record.num_preempted)
            self._num_steps_seen = stats.num_steps
        self.running.set(engine.scheduler.num_running)
        self.waiting.set(engine.scheduler.num_waiting)
        self.kv_used.set(engine.block_manager.num_used_blocks)


def model_is_decoupled(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))

