"""What the two Triton models share: request parsing, engine settings from config.pbtxt, responses, metrics.

This is the one module that speaks Triton's Python-backend API. It receives ``triton_python_backend_utils`` as an
argument (``pb``) instead of importing it, so the rest of ``backend/`` and its tests run without a server.
Request parsing itself is plain Python on numpy arrays and raises ``ValueError`` with a message for the client.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from backend.engine.config import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, EngineConfig, SamplingParams
from backend.engine.llm_engine import RequestOutput
from backend.triton.shutdown import drain_grace, server_args

log = logging.getLogger(__name__)

# Inputs every model declares (model_repository/README.md). Anything else is refused by Triton itself.
SAMPLING_INPUTS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")
# Input names other Triton LLM backends use for a sampling setting (TensorRT-LLM's), sent as they are by their clients.
SAMPLING_INPUT_ALIASES = {"min_length": "min_tokens"}
# vllm_backend's switches for optional outputs. Ours are returned unless a request turns them off.
RETURN_INPUTS = {
    "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens",
    "return_finish_reason": "finish_reason",
}
ALL_INPUTS = (
    "text_input", *SAMPLING_INPUTS, *SAMPLING_INPUT_ALIASES, "stop", "stream", "sampling_parameters",
    "exclude_input_in_output", *RETURN_INPUTS,
)
SAMPLING_KEYS = tuple(sorted(f.name for f in fields(SamplingParams)))
DEFAULT_MAX_TOKENS = 16
# A prompt is refused before tokenising when its UTF-8 bytes exceed this many per token of max_model_len
# (no tokenizer needs more), so a 10 MB text_input costs no tokenizer time and no memory spike.
MAX_PROMPT_BYTES_PER_TOKEN = 16
# sampling_parameters and the request parameters are small JSON objects; 16 stop strings of 256 characters,
# JSON-escaped, fit with room to spare.
MAX_PARAMETERS_BYTES = 64 * 1024
# A model parameter that is read only when this environment variable is "1" (tests inject engine faults).
FAULTS_ENV_VAR = "LLM_TEST_FAULTS"
FAULTS_PARAMETER = "fault_injection"


# ---- engine settings ----------------------------------------------------------------------------------------


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


# ---- requests -----------------------------------------------------------------------------------------------


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


def parse_request(inputs: dict[str, np.ndarray], limits: RequestLimits, parameters: str = "") -> ParsedRequest:
    """Validate one request: its input tensors (``name -> numpy array``, missing optional inputs absent) and its
    request parameters (a JSON object; Triton's HTTP /generate passes JSON fields that are not inputs there).

    Sampling settings are layered: input tensors, then request parameters, then the ``sampling_parameters`` JSON.
    Keys that are not sampling settings are refused wherever they appear.
    """
    if "text_input" not in inputs:
        raise ValueError("missing required input 'text_input'")
    texts = inputs["text_input"].reshape(-1)
    if texts.size != 1:
        raise ValueError(f"text_input must hold exactly one prompt per request; got {texts.size}")
    raw = texts[0]
    if isinstance(raw, str):
        raw = raw.encode("utf-8")
    if len(raw) > limits.max_prompt_bytes:
        raise ValueError(
            f"text_input is {len(raw)} bytes; the limit is {limits.max_prompt_bytes} bytes "
            f"({MAX_PROMPT_BYTES_PER_TOKEN} per token of max_model_len {limits.max_model_len})"
        )
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
    for alias, name in SAMPLING_INPUT_ALIASES.items():
        if alias in inputs:
            if name in inputs:
                raise ValueError(f"send either '{name}' or '{alias}' (the same setting), not both")
            values[name] = _scalar(alias, inputs[alias])
    if "stop" in inputs:
        values["stop"] = _stop_strings(inputs["stop"])
    values.update(_json_object("the request parameters", parameters))
    if "sampling_parameters" in inputs:
        text = _text("sampling_parameters", _scalar("sampling_parameters", inputs["sampling_parameters"]))
        values.update(_json_object("sampling_parameters", text))
    stream = bool(_scalar("stream", inputs["stream"])) if "stream" in inputs else False
    params = SamplingParams.from_dict(values)
    omitted = frozenset(out for name, out in RETURN_INPUTS.items() if name in inputs and not _scalar(name, inputs[name]))
    if params.max_tokens is not None and params.max_tokens >= limits.max_model_len:
        raise ValueError(
            f"max_tokens is {params.max_tokens}, beyond this model's max_model_len ({limits.max_model_len}): "
            f"prompt and output together must fit in max_model_len, so at most {limits.max_model_len - 1} tokens "
            "can be generated"
        )
    return ParsedRequest(prompt, params, stream, omitted)


def _json_object(source: str, text: str) -> dict[str, Any]:
    """A JSON object of sampling settings (numbers may be strings, as genai-perf sends them)."""
    if not text:
        return {}
    if len(text) > MAX_PARAMETERS_BYTES:
        raise ValueError(f"{source} is {len(text)} characters; the limit is {MAX_PARAMETERS_BYTES}")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{source} must be a JSON object")
    unknown = sorted(set(raw) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) in {source}: {', '.join(unknown)}; known: {', '.join(SAMPLING_KEYS)}")
    return raw


def _stop_strings(array: np.ndarray) -> list[str]:
    flat = array.reshape(-1)
    if flat.size > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed; got {flat.size}")
    for value in flat:  # refuse a huge one before decoding it (4 bytes per character at most)
        if isinstance(value, (bytes, np.bytes_)) and len(value) > 4 * MAX_STOP_STRING_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters; "
                             f"got one of {len(value)} bytes")
    return [_text("stop", s) for s in flat]


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
            raise ValueError(f"{what}; got {count}")
        inputs[name] = tensor.as_numpy()
    return inputs


def read_parameters(request) -> str:
    """The request parameters as a JSON object string ("" when none were sent)."""
    text = request.parameters()
    return "" if text in ("", "{}") else text


# ---- responses ----------------------------------------------------------------------------------------------


@dataclass
class OpenRequest:
    """A request the server has accepted and not yet answered finally. Used only by the thread that sends."""

    sender: Any
    stream: bool
    arrival: float = field(default_factory=time.perf_counter)
    omitted_outputs: frozenset[str] = frozenset()
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
    tensors = make_output_tensors(pb, text, token_ids, output, batched, open_request.omitted_outputs)
    open_request.sender.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)


def make_output_tensors(
    pb, text: str, token_ids: list[int], output: RequestOutput, batched: bool, omitted: frozenset[str] = frozenset()
) -> list:
    lead = (1,) if batched else ()  # a model with max_batch_size > 0 answers with a batch dimension
    reason = output.finish_reason if output.finished else ""
    arrays = {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.array(token_ids, dtype=np.int32),
        "finish_reason": np.array([(reason or "").encode()], dtype=np.object_),
        "num_input_tokens": np.array([output.num_prompt_tokens], dtype=np.int32),
        "num_output_tokens": np.array([output.num_output_tokens], dtype=np.int32),
    }
    return [pb.Tensor(name, array.reshape(lead + (-1,))) for name, array in arrays.items() if name not in omitted]


# NOTE: error responses carry Triton's default code: a decoupled model's errors reach clients as text only (gRPC
# stream error_message; HTTP /generate answers 400 to every model error in 2.51), so the message says it all.
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
        self.engine_healthy = family(
            "llm_engine_healthy", "1 while the engine serves; 0 once it failed and refuses every request "
            "(Triton 2.51 lets a Python model report this nowhere else)", F.GAUGE).Metric(labels)
        self.engine_healthy.set(1)

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


# ---- shutdown ---------------------------------------------------------------------------------------------


class ShutdownNotice:
    """Notice, inside a Python-backend stub process, that the server is shutting down: SIGTERM or SIGINT arrives.

    Triton 2.51 tells a Python model nothing until it finalizes it, and by then the model can no longer respond
    (and it finalizes a model only once every client stream that used it is closed). So whoever stops the server
    signals the stubs too (``backend.triton.shutdown.stop``: the launcher, the container's entry, the tests), and the
    model drains: it refuses new requests, lets the ones it has run for ``grace`` seconds, and then ends the rest
    with "the server is shutting down" — before tritonserver's own ``--exit-timeout-secs`` runs out.
    ``on_notice(grace)`` runs on a watcher thread.

    NOTE: the stub's own C handler ignores these signals. Python's replaces it; its C-level part writes the signal
    number to the wakeup fd at once, whatever the main thread is doing, and the watcher thread reads it there.
    Must be created on the stub's main thread (initialize()).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, on_notice: Callable[[float], None] | None = None, grace: float | None = None) -> None:
        self.grace = shutdown_grace() if grace is None else grace
        self.deadline: float | None = None  # time.monotonic() after which nothing more runs
        self._on_notice = on_notice
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd)
        for sig in self.SIGNALS:
            signal.signal(sig, lambda *_: None)  # the wakeup fd does the work
        threading.Thread(target=self._watch, args=(read_fd,), name="shutdown-notice", daemon=True).start()

    def is_set(self) -> bool:
        return self.deadline is not None

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _watch(self, read_fd: int) -> None:
        while not set(os.read(read_fd, 64)) & {int(s) for s in self.SIGNALS}:
            pass
        log.warning("shutdown signal: refusing new requests, ending open ones within %.1f s", self.grace)
        self.deadline = time.monotonic() + self.grace
        if self._on_notice is not None:
            self._on_notice(self.grace)


def shutdown_grace(parent_pid: int | None = None) -> float:
    """Seconds to keep serving after a shutdown signal: tritonserver's exit timeout (read from its command line,
    as this process is its child) less a margin (``backend.triton.shutdown.drain_grace``)."""
    return drain_grace(server_args(parent_pid or os.getppid()))


# ---- test-only fault injection ------------------------------------------------------------------------------


class InjectedFatalError(BaseException):
    """Test-only: a fault the engine cannot recover from. Not an ``Exception``, so no step's handler catches it."""


class FaultInjector:
    """Test-only engine faults for requests whose prompt contains a marker; the engine's ``fault_hook``.

    Active only when config.pbtxt has the parameter ``fault_injection`` (a JSON object such as
    ``{"step_error": "<<fail-step>>", "fatal_error": "<<kill-engine>>"}``) *and* the server runs with
    ``LLM_TEST_FAULTS=1``. ``step_error`` makes the step that runs the request raise, as a failing forward would:
    that step's requests fail and serving goes on. ``fatal_error`` raises past the step's error handling, as a
    broken engine would: the model must fail every open request and refuse new ones.
    """

    KINDS = ("step_error", "fatal_error")

    def __init__(self, markers: dict[str, str]) -> None:
        unknown = sorted(set(markers) - set(self.KINDS))
        if unknown or not all(isinstance(m, str) and m for m in markers.values()):
            raise ValueError(f"{FAULTS_PARAMETER} must map {' / '.join(self.KINDS)} to non-empty marker strings")
        self.markers = markers
        self._armed: dict[str, str] = {}  # request id -> kind; written by execute(), read by the engine thread
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, model_config: dict) -> FaultInjector | None:
        raw = model_config.get("parameters", {}).get(FAULTS_PARAMETER, {}).get("string_value", "")
        if not raw:
            return None
        if os.environ.get(FAULTS_ENV_VAR) != "1":
            log.warning("ignoring the %s parameter: it is read only when %s=1", FAULTS_PARAMETER, FAULTS_ENV_VAR)
            return None
        try:
            markers = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{FAULTS_PARAMETER} is not valid JSON: {exc.msg}") from None
        return cls(markers)

    def watch(self, request_id: str, prompt: str) -> None:
        for kind, marker in self.markers.items():
            if marker in prompt:
                with self._lock:
                    self._armed[request_id] = kind

    def __call__(self, requests: list) -> None:
        with self._lock:
            hits = {r.request_id: self._armed.pop(r.request_id) for r in requests if r.request_id in self._armed}
        if "fatal_error" in hits.values():
            raise InjectedFatalError(f"injected fatal engine fault (requests {sorted(hits)})")
        if hits:
            raise RuntimeError(f"injected step fault (requests {sorted(hits)})")


def model_is_decoupled(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))

