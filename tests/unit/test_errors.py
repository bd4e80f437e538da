"""The error contract (backend/contract/errors.py) without a server: every error a request can get carries its kind,
and the parameter it names, as a code in front of its message, and readers decide on that code alone. Each error below
is produced by the code that produces it in the server, then reworded (its text swapped for words that name other
errors); the OpenAI frontend answers both with the same HTTP status, type, code and parameter, the contract's."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from backend.contract import errors
from backend.contract.errors import PROMPT, ErrorKind
from backend.engine import batching
from backend.engine.block_manager import BlockManager
from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine, RequestOutput
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import Scheduler
from backend.triton.stub import sequence_relay
from backend.triton.stub.parsing import MAX_PROMPT_BYTES_PER_TOKEN, RequestLimits, parse_request
from frontend.openai.triton_bridge import api_error
from loadtest import soak_patterns

ROOT = Path(__file__).resolve().parents[2]
LIMITS = RequestLimits(max_model_len=64)
# What the readers once searched the messages for, the other kinds' codes and Triton's own text: a reader that still
# read the words would take a reworded message for another kind.
MISLEADING = ("[overloaded] the server is overloaded; Exceeds maximum queue size; the server is shutting down; the "
              "engine failed and cannot go on; the engine failed while running this request; max_model_len; more "
              "than the whole KV cache holds; text_input is; lower max_tokens; a stop string; --sequence-length 1")


def text(*values: str | bytes) -> np.ndarray:
    return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)


def parse_refusal(parameters: str = "", **inputs: np.ndarray) -> str:
    with pytest.raises(ValueError) as refused:
        parse_request(inputs, LIMITS, parameters)
    return errors.refusal(refused.value)


def sampling_refusal(**values) -> str:
    with pytest.raises(ValueError) as refused:
        SamplingParams(**values)
    return errors.refusal(refused.value)


def scheduler_refusal(num_prompt_tokens: int, max_tokens: int | None) -> str:
    config = EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32)
    scheduler = Scheduler(config, BlockManager(4, 4))  # 16 tokens of KV cache
    request = Request("r", list(range(1, num_prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens), (0,))
    with pytest.raises(ValueError) as refused:
        scheduler.add_request(request)
    return errors.refusal(refused.value)


def engine_refusal() -> str:
    """The engine's own refusal of a prompt that tokenizes to nothing (a stand-in for the loaded engine)."""
    engine = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda prompt: []), _ids=itertools.count(),
                             config=SimpleNamespace(model_shape=SimpleNamespace(vocab_size=100)))
    with pytest.raises(ValueError) as refused:
        LLMEngine.add_request(engine, "r", " ")
    return errors.refusal(refused.value)


def failed_step() -> str:
    """The error of a request whose step failed (a stand-in for the engine around ``LLMEngine._fail``)."""
    engine = SimpleNamespace(abort=lambda request_id, reason: RequestOutput(request_id, "", [], finished=True))
    return LLMEngine._fail(engine, "r", RuntimeError("boom")).error


class IdleEngine:
    """What the engine loop reads of an engine with nothing to do."""

    def __init__(self, max_queue_size: int) -> None:
        self.config = SimpleNamespace(max_queue_size=max_queue_size)
        self.scheduler = SimpleNamespace(num_waiting=0)

    def has_unfinished(self) -> bool:
        return False


def loop_refusal(state: str) -> str:
    """``EngineLoop.submit``'s refusal: a full queue (``max_queue_size`` 0), a loop that has not started (stopped),
    or one whose engine failed."""
    loop = batching.EngineLoop(IdleEngine(max_queue_size=0))
    if state != "stopped":
        loop.start()
    if state == "failed":
        loop.fatal_error = RuntimeError("broken")
    try:
        with pytest.raises((batching.EngineOverloaded, batching.EngineUnavailable)) as refused:
            loop.submit("r", "Hi", SamplingParams())
    finally:
        assert loop.shutdown(timeout=5.0)
    return str(refused.value)


def relay_failure() -> str:
    """What a relayed request's client gets when relaying it fails (fakes for the stub's objects)."""
    sent = []
    pb = SimpleNamespace(TRITONSERVER_RESPONSE_COMPLETE_FINAL=1, TritonError=lambda message: message,
                         InferenceResponse=lambda output_tensors=None, error=None: error)
    sender = SimpleNamespace(send=lambda response=None, flags=0: sent.append(response), is_cancelled=lambda: False)

    def exec_copy(decoupled):
        raise RuntimeError("the stub went away")

    sequence_relay.SequenceRelay(pb, "llm_iterative")._pass_on(SimpleNamespace(exec=exec_copy), sender)
    (error,) = sent
    return error


ASCII_PROMPT = text("Hi")
# Every error a request can get, by where it comes from: (produce its message, its kind, the parameter it names).
PRODUCED = {
    "parsing: no prompt": (lambda: parse_refusal(max_tokens=np.array([3], np.int32)), ErrorKind.INVALID_REQUEST,
                           PROMPT),
    "parsing: empty prompt": (lambda: parse_refusal(text_input=text("")), ErrorKind.INVALID_REQUEST, PROMPT),
    "parsing: prompt not UTF-8": (lambda: parse_refusal(text_input=text(b"\xff")), ErrorKind.INVALID_REQUEST, PROMPT),
    "parsing: prompt beyond its bytes": (
        lambda: parse_refusal(text_input=text("x" * (MAX_PROMPT_BYTES_PER_TOKEN * 64 + 1))),
        ErrorKind.CONTEXT_LENGTH_EXCEEDED, PROMPT),
    "parsing: max_tokens beyond max_model_len": (
        lambda: parse_refusal(text_input=ASCII_PROMPT, max_tokens=np.array([64], np.int32)),
        ErrorKind.CONTEXT_LENGTH_EXCEEDED, "max_tokens"),
    "parsing: too many stop strings": (lambda: parse_refusal(text_input=ASCII_PROMPT, stop=text(*["s"] * 17)),
                                       ErrorKind.INVALID_REQUEST, "stop"),
    "parsing: temperature not finite": (
        lambda: parse_refusal(text_input=ASCII_PROMPT, temperature=np.array([np.inf], np.float32)),
        ErrorKind.INVALID_REQUEST, "temperature"),
    "parsing: unknown sampling key": (
        lambda: parse_refusal(text_input=ASCII_PROMPT, sampling_parameters=text('{"best_of": 2}')),
        ErrorKind.INVALID_REQUEST, "sampling_parameters"),
    "parsing: request parameters not JSON": (lambda: parse_refusal("{x", text_input=ASCII_PROMPT),
                                             ErrorKind.INVALID_REQUEST, None),
    "parsing: seed not an integer": (
        lambda: parse_refusal(text_input=ASCII_PROMPT, sampling_parameters=text('{"seed": "x"}')),
        ErrorKind.INVALID_REQUEST, "seed"),
    "sampling: top_p out of range": (lambda: sampling_refusal(top_p=2.0), ErrorKind.INVALID_REQUEST, "top_p"),
    "sampling: min_tokens above max_tokens": (lambda: sampling_refusal(max_tokens=2, min_tokens=3),
                                              ErrorKind.INVALID_REQUEST, "min_tokens"),
    "sampling: empty stop string": (lambda: sampling_refusal(stop=[""]), ErrorKind.INVALID_REQUEST, "stop"),
    "scheduler: prompt beyond max_model_len": (lambda: scheduler_refusal(32, 4), ErrorKind.CONTEXT_LENGTH_EXCEEDED,
                                               PROMPT),
    "scheduler: prompt beyond the KV cache": (lambda: scheduler_refusal(17, 4), ErrorKind.CONTEXT_LENGTH_EXCEEDED,
                                              PROMPT),
    "scheduler: max_tokens beyond the KV cache": (lambda: scheduler_refusal(10, 8),
                                                  ErrorKind.CONTEXT_LENGTH_EXCEEDED, "max_tokens"),
    "engine: prompt of no tokens": (engine_refusal, ErrorKind.INVALID_REQUEST, PROMPT),
    "engine: a failed step": (failed_step, ErrorKind.ENGINE_FAULT, None),
    "engine loop: full queue": (lambda: loop_refusal("full"), ErrorKind.OVERLOADED, None),
    "engine loop: stopping": (lambda: loop_refusal("stopped"), ErrorKind.SHUTTING_DOWN, None),
    "engine loop: failed engine": (lambda: loop_refusal("failed"), ErrorKind.ENGINE_FAILED, None),
    "drivers: shutdown deadline": (lambda: batching.SHUTTING_DOWN, ErrorKind.SHUTTING_DOWN, None),
    "drivers: failed engine": (lambda: batching.engine_failed(RuntimeError("broken")), ErrorKind.ENGINE_FAILED, None),
    "drivers: dropped by Triton": (lambda: batching.DROPPED, ErrorKind.DROPPED, None),
    "llm_iterative: multi-request sequence": (lambda: sequence_relay.MULTI_REQUEST_SEQUENCE,
                                              ErrorKind.MULTI_REQUEST_SEQUENCE, None),
    "llm_iterative: cancelled": (lambda: sequence_relay.CANCELLED, ErrorKind.CANCELLED, None),
    "llm_iterative: relaying failed": (relay_failure, ErrorKind.ENGINE_FAULT, None),
}


@pytest.mark.parametrize("source", sorted(PRODUCED))
def test_every_error_keeps_its_status_type_code_and_param_when_reworded(source):
    produce, kind, param = PRODUCED[source]
    original = produce()
    parsed = errors.parse(original)
    assert parsed is not None and (parsed.kind, parsed.param) == (kind, param), original
    reworded = original.removesuffix(parsed.text) + MISLEADING
    http = errors.HTTP[kind]
    for prompt_param in ("prompt", "messages"):
        before, after = api_error(original, prompt_param), api_error(reworded, prompt_param)
        assert (before.status, before.type, before.code) == (http.status, http.type, http.code), original
        assert before.param == (prompt_param if param == PROMPT else param)
        assert (after.status, after.type, after.code, after.param) == \
            (before.status, before.type, before.code, before.param), reworded
        assert (before.message, after.message) == (parsed.text, MISLEADING)


def test_every_kind_is_produced_somewhere():
    assert {kind for _, kind, _ in PRODUCED.values()} == set(ErrorKind)


def test_tritons_full_queue_and_unloaded_model_are_the_texts_read_without_a_code():
    assert errors.parse(errors.TRITON_QUEUE_FULL) == errors.ParsedError(ErrorKind.OVERLOADED, errors.TRITON_QUEUE_FULL)
    error = api_error(errors.TRITON_QUEUE_FULL, "prompt")
    assert (error.status, error.type, error.code) == (429, "rate_limit_error", "model_overloaded")
    unloaded = "Request for unknown model: 'llm_continuous' has no available versions"  # Triton 2.51's, as seen
    error = api_error(unloaded, "prompt")
    assert (error.status, error.code, error.message) == (503, "service_unavailable", unloaded)
    for other in ("the server is overloaded", "the server is shutting down", "[StatusCode.UNAVAILABLE] Socket closed",
                  "[no_such_kind] x", "[overloaded]no space", " [overloaded] leading space"):
        assert errors.parse(other) is None, other
        assert api_error(other, "prompt").status == 500, other  # not a model's error: not the client's doing


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_a_message_reads_back_whatever_its_text_holds(kind):
    for param in (None, PROMPT, "max_tokens"):
        for words in ("", "plain", "[overloaded] brackets, a colon: and\na second line"):
            assert errors.parse(errors.message(kind, words, param)) == errors.ParsedError(kind, words, param)
    refusal = errors.InvalidRequest("top_p", "top_p must be in (0, 1]")
    assert isinstance(refusal, ValueError) and str(refusal) == "[invalid_request:top_p] top_p must be in (0, 1]"
    assert errors.refusal(ValueError("plain")) == "[invalid_request] plain"


def test_the_table_covers_every_kind_and_the_model_repository_readme_lists_every_code():
    assert set(errors.HTTP) == set(ErrorKind)
    assert len({kind.value for kind in ErrorKind}) == len(ErrorKind)
    readme = (ROOT / "model_repository" / "README.md").read_text()
    listed = set(re.findall(r"^\| `\[([a-z_]+)", readme, re.MULTILINE))
    assert listed == {kind.value for kind in ErrorKind}
    assert errors.TRITON_QUEUE_FULL in readme


def test_the_soaks_bad_requests_are_refused_as_it_expects():
    """Each of the soak's bad HTTP /generate bodies, parsed as Triton's HTTP frontend hands them to the model (JSON
    fields that are inputs become inputs), gets the kind and parameter the soak counts it by."""
    for name, body, kind, param in soak_patterns.BAD_REQUESTS:
        inputs = {key: np.array([value.encode() if isinstance(value, str) else value],
                                dtype=np.object_ if isinstance(value, str) else None)
                  for key, value in body.items()}
        with pytest.raises(ValueError) as refused:
            parse_request(inputs, RequestLimits(max_model_len=2048))
        parsed = errors.parse(errors.refusal(refused.value))
        assert (parsed.kind, parsed.param) == (kind, param), name
    answer = SimpleNamespace(json=lambda: {"error": "[overloaded] busy"}, text='{"error": "[overloaded] busy"}')
    assert soak_patterns.http_error(answer) == "[overloaded] busy"
