"""Every error a request can get, named once for every layer: the models produce them, the OpenAI frontend, the client
and the load tests read them.

An error reaches a client as its message alone (in Triton 2.51's Python backend ``pb_utils.TritonError(message)`` is all
an error response carries: a gRPC stream passes the message on, HTTP /generate answers 400 with ``{"error": message}``
whatever the error: triton_workarounds.ERROR_IS_A_MESSAGE), so its kind travels at the front of the message, as a code
in brackets:

    [overloaded] the server is overloaded: 12 requests are already waiting (max_queue_size=8); retry later
    [invalid_request:top_p] top_p must be in (0, 1]; got 2.0
    [context_length_exceeded:max_tokens] max_tokens is 5000, beyond this model's max_model_len (2048): ...

``[kind]`` or ``[kind:param]``, one space, then the text for a person. ``param`` names the request's input or
sampling setting the error is about (:data:`PROMPT` for the prompt). :func:`message` writes the code (and
:class:`InvalidRequest` through it), :func:`parse` reads it back, and :data:`HTTP` says what each kind means to an
HTTP client. Readers decide on the kind and the parameter only: the text after the code may be reworded freely.

NOTE: standard library only, nothing else of the project imported (the package's rule, ``__init__.py``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass


class ErrorKind(enum.Enum):
    """Every error a request can get; the value is its code in the message."""

    OVERLOADED = "overloaded"  # the engine's max_queue_size requests already wait (or Triton's queue is full)
    SHUTTING_DOWN = "shutting_down"  # the server is stopping: new requests refused, open ones ended at the deadline
    ENGINE_FAILED = "engine_failed"  # the engine broke and cannot go on: every request fails until a restart
    ENGINE_FAULT = "engine_fault"  # serving this request failed (its engine step, the relay); other requests go on
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt or max_tokens beyond max_model_len or the KV cache
    INVALID_REQUEST = "invalid_request"  # a value the request sent that the model cannot take
    DROPPED = "dropped"  # the server lost the request (Triton's sequence batcher), not the client's doing: resend it
    MULTI_REQUEST_SEQUENCE = "multi_request_sequence"  # llm_iterative: a client sequence of more than one request
    CANCELLED = "cancelled"  # its client cancelled it


@dataclass(frozen=True)
class HttpError:
    """What a kind of error means to an HTTP client: the status, and OpenAI's error ``type`` and ``code``."""

    status: int
    type: str
    code: str | None


# The one table from kind to HTTP; the OpenAI frontend answers with it (docs/clients.md lists it).
HTTP: dict[ErrorKind, HttpError] = {
    ErrorKind.OVERLOADED: HttpError(429, "rate_limit_error", "model_overloaded"),
    ErrorKind.SHUTTING_DOWN: HttpError(503, "server_error", "service_unavailable"),
    ErrorKind.ENGINE_FAILED: HttpError(503, "server_error", "service_unavailable"),
    ErrorKind.ENGINE_FAULT: HttpError(500, "server_error", "internal_error"),
    ErrorKind.CONTEXT_LENGTH_EXCEEDED: HttpError(400, "invalid_request_error", "context_length_exceeded"),
    ErrorKind.INVALID_REQUEST: HttpError(400, "invalid_request_error", None),
    ErrorKind.DROPPED: HttpError(503, "server_error", "service_unavailable"),
    ErrorKind.MULTI_REQUEST_SEQUENCE: HttpError(400, "invalid_request_error", "unsupported_sequence"),
    # 499, nginx's "client closed request": the client that cancelled is gone and reads none of it.
    ErrorKind.CANCELLED: HttpError(499, "invalid_request_error", "request_cancelled"),
}

# The parameter an error about the prompt names: the models' input that carries it (model_repository/README.md).
PROMPT = "text_input"

# Triton's own refusal when a model's queue is full (its batcher's max_queue_size: llm_dynamic, llm_static,
# llm_iterative). Triton writes it, so it carries no code: the one text of Triton's a reader may look for, read as
# OVERLOADED.
TRITON_QUEUE_FULL = "Exceeds maximum queue size"
# Triton's refusal of a request for a model it has unloaded, as the stop does to every model before the server exits
# (an explicit unload does it to one): read as SHUTTING_DOWN, a 503 that a router retries on another replica.
TRITON_MODEL_UNLOADED = "has no available versions"

_CODED = re.compile(r"\[([a-z_]+)(?::([A-Za-z0-9_.]+))?\] (.*)", re.DOTALL)
_KINDS = {kind.value: kind for kind in ErrorKind}


def message(kind: ErrorKind, text: str, param: str | None = None) -> str:
    """The message a client gets: ``text`` (for a person) behind the code of ``kind`` and ``param``."""
    return f"[{kind.value}{'' if param is None else ':' + param}] {text}"


@dataclass(frozen=True)
class ParsedError:
    """An error message read back: its kind, the parameter it names, and the text behind the code."""

    kind: ErrorKind
    text: str
    param: str | None = None


def parse(error_message: str) -> ParsedError | None:
    """The kind, parameter and text of an error message; None for a message that carries no code and is not one of
    Triton's own that are read (:data:`TRITON_QUEUE_FULL`, :data:`TRITON_MODEL_UNLOADED`)."""
    coded = _CODED.fullmatch(error_message)
    if coded is not None and coded[1] in _KINDS:
        return ParsedError(_KINDS[coded[1]], coded[3], coded[2])
    if TRITON_QUEUE_FULL in error_message:
        return ParsedError(ErrorKind.OVERLOADED, error_message)
    if TRITON_MODEL_UNLOADED in error_message:
        return ParsedError(ErrorKind.SHUTTING_DOWN, error_message)
    return None


class InvalidRequest(ValueError):
    """A request refused for a value it sent: a ``ValueError`` like every check of a config, whose ``str()`` is the
    coded message (``[invalid_request:param] text``). ``param`` is None when no single parameter is to blame."""

    kind = ErrorKind.INVALID_REQUEST

    def __init__(self, param: str | None, text: str) -> None:
        super().__init__(message(self.kind, text, param))
        self.param, self.text = param, text


def refuse_unknown(given: Iterable[str], known: Iterable[str], param: str | None, what: str) -> None:
    """An :class:`InvalidRequest` when ``given`` holds keys beyond ``known``: ``what`` (e.g. ``unknown key(s) in
    x``), then those keys and the known ones."""
    known = set(known)
    unknown = sorted(set(given) - known)
    if unknown:
        raise InvalidRequest(param, f"{what}: {', '.join(unknown)}; known: {', '.join(sorted(known))}")


class ContextLengthExceeded(InvalidRequest):
    """The prompt (``param`` :data:`PROMPT`), or the prompt and ``max_tokens`` (``param`` ``max_tokens``), would not
    fit in max_model_len or the KV cache."""

    kind = ErrorKind.CONTEXT_LENGTH_EXCEEDED


def refusal(exc: ValueError) -> str:
    """The message for a ``ValueError`` that refused one request: an :class:`InvalidRequest` 's own; any other's
    text as an invalid request."""
    return str(exc) if isinstance(exc, InvalidRequest) else message(ErrorKind.INVALID_REQUEST, str(exc))
