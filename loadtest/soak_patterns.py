"""The client behaviours the soak plays against each model (``loadtest/soak.py`` runs them): the ways users' clients
use, and misuse, the server. Each pattern is a function that one client thread runs until its cell's budget of
requests (or of time) is spent, and accounts for every request it sent as exactly one outcome:

- ``completed``: the whole answer (greedy, ``ignore_eos``: exactly ``max_tokens`` tokens, finish reason "length");
- ``cancelled``: the client cancelled it or dropped its connection (that the server let it go is what the soak
  checks afterwards: nothing pending in Triton, the KV blocks back to 0);
- ``error``: refused, or ended with an error of an expected kind (overloaded, a sequence Triton cannot serve, a bad
  request; the kind is the code in front of the message, backend/contract/errors.py), counted by reason;
- ``lost``: no final response within the request timeout, a wrong answer, or an error nobody expects.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import requests

from backend.contract import errors
from backend.contract.errors import PROMPT, ErrorKind
from client.grpc_stream import GrpcStream, StreamSession, max_batch_size, start_stream
from client.schema import input_tensors, raw_input_values
from loadtest.runner import max_num_seqs

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small birds sing about rivers mountains and old cities "
    "under bright stars near quiet harbours where ships wait for morning tides"
).split()
MAX_CANCEL_AFTER = 8  # a cancelled or dropped request goes after 0 to this many tokens (events, chunks)

# Errors that say why, and the reason each is counted under: a kind of the models' errors, or a text of Triton's own
# (which carries no kind).
OVERLOADED = {ErrorKind.OVERLOADED: "overloaded"}  # beyond max_queue_size (Triton's own refusal included), any pattern
# perf_analyzer's sequences of several requests on llm_iterative (model_repository/llm_iterative/1/model.py): the
# model's answer to the second request and Triton's refusal of a request without START once it has closed the
# sequence. Which of the two the second request gets is a race.
SEQUENCE_REFUSALS = {
    ErrorKind.MULTI_REQUEST_SEQUENCE: "multi-request sequence",
    "must specify the START flag on the first request of the sequence": "sequence closed by Triton",
}
# Bad requests and what each must be refused with: (name, HTTP /generate body, kind, the parameter it names).
BAD_REQUESTS = [
    ("empty_prompt", {"text_input": ""}, ErrorKind.INVALID_REQUEST, PROMPT),
    ("max_tokens_0", {"text_input": "Hi", "max_tokens": 0}, ErrorKind.INVALID_REQUEST, "max_tokens"),
    ("top_p_2", {"text_input": "Hi", "top_p": 2.0}, ErrorKind.INVALID_REQUEST, "top_p"),
    ("unknown_key", {"text_input": "Hi", "sampling_parameters": '{"best_of": 2}'}, ErrorKind.INVALID_REQUEST,
     "sampling_parameters"),
    ("broken_json", {"text_input": "Hi", "sampling_parameters": "{max_tokens:"}, ErrorKind.INVALID_REQUEST,
     "sampling_parameters"),
    ("prompt_too_large", {"text_input": "x" * 100_000}, ErrorKind.CONTEXT_LENGTH_EXCEEDED, PROMPT),
]


# ---- what a cell shares: its target, budget and accounts ------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The server's addresses and the sizes of the requests the patterns send."""

    grpc_url: str
    http_url: str
    openai_url: str | None  # the OpenAI frontend; None when it is not running
    request_timeout: float
    max_tokens: int  # the largest max_tokens of a request that runs to its end
    long_tokens: int  # max_tokens of a request that is cancelled or dropped before its end
    sequence_length: int  # the longest multi-request sequence (perf_analyzer's default is 20)


class Budget:
    """The requests a cell may still send: at most ``num_requests`` in all, and none once ``seconds`` have passed."""

    def __init__(self, num_requests: int, seconds: float) -> None:
        self.num_left = num_requests
        self.deadline = time.monotonic() + seconds
        self._lock = threading.Lock()

    def take(self, count: int = 1) -> int:
        """Up to ``count`` requests (fewer near the end of the budget, 0 once it is spent or out of time)."""
        with self._lock:
            if time.monotonic() >= self.deadline:
                return 0
            granted = min(count, self.num_left)
            self.num_left -= granted
            return granted


class Accounts:
    """Every request's outcome; errors counted by reason, the lost ones keep theirs. ``failures``: clients that
    failed before they sent anything."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.lost: list[str] = []
        self.failures: list[str] = []

    def add(self, outcome: str, reason: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            if outcome == "error":
                self.errors[reason] += 1
            elif outcome == "lost" and len(self.lost) < 50:
                self.lost.append(reason[:300])

    @property
    def num_requests(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int
    stream: bool

    @property
    def values(self) -> dict:
        """The request's inputs besides the prompt: greedy, the length fixed by ignore_eos."""
        return {"max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": self.stream}


class Client:
    """Client number ``index`` of a cell: the model it sends to, its own random choices, and the cell's shared budget
    and accounts. ``num_open``: requests taken from the budget and not accounted for yet."""

    def __init__(self, index: int, target: Target, model: str, rng: random.Random, budget: Budget,
                 accounts: Accounts) -> None:
        self.index = index
        self.target, self.model, self.rng = target, model, rng
        self.budget, self.accounts = budget, accounts
        self.num_sent = 0
        self.num_open = 0

    def take(self, count: int = 1) -> int:
        granted = self.budget.take(count)
        self.num_sent += granted
        self.num_open += granted
        return granted

    def requests(self) -> Iterator[int]:
        """A number for each request this client may send, one at a time, until the budget is spent: the client's
        index, then one more each time, so that choices by turns (streamed or not) alternate across clients too."""
        while self.take():
            yield self.index + self.num_sent - 1

    def account(self, outcome: str, reason: str = "") -> None:
        self.num_open -= 1
        self.accounts.add(outcome, reason)

    def lose_open(self, reason: str) -> None:
        """Account every open request as lost (the client failed or gave up while they were open)."""
        for _ in range(self.num_open):
            self.account("lost", reason)

    def prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(2, 40)))

    def request(self, index: int) -> Request:
        """A request that runs to its end: 2-40 words, 1 to max_tokens tokens, streamed every other time."""
        return Request(self.prompt(), self.rng.randint(1, self.target.max_tokens), stream=index % 2 == 0)

    def long_request(self) -> Request:
        """A streamed request long enough to be cancelled or dropped before its end."""
        return Request(self.prompt(), self.target.long_tokens, stream=True)

    def tensors(self, request: Request) -> list:
        values = raw_input_values(request.prompt, **request.values)
        return input_tensors(values, max_batch_size(self.target.grpc_url, self.model))


def play(pattern: Callable[[Client], None], client: Client) -> None:
    """Run ``pattern`` for ``client`` until the budget is spent. An exception loses the requests that were open, and
    the client goes on with the rest of the budget; one before any request was sent ends the client."""
    while True:
        try:
            pattern(client)
            return
        except Exception as exc:
            reason = f"client: {type(exc).__name__}: {exc}"
            if client.num_open == 0:
                with client.accounts.lock:
                    client.accounts.failures.append(reason[:300])
                return
            client.lose_open(reason)


# ---- outcomes -------------------------------------------------------------------------------------------------


def error_outcome(message: str, expected: dict[ErrorKind | str, str] | None = None) -> tuple[str, str]:
    """("error", reason) for an error that says why (overloaded, or one of ``expected``: by its kind, or for Triton's
    own errors by their text), else ("lost", message)."""
    error = errors.parse(message)
    for key, reason in {**OVERLOADED, **(expected or {})}.items():
        if (error is not None and error.kind is key) or (isinstance(key, str) and key in message):
            return "error", reason
    return "lost", f"unexpected error: {message}"


def http_error(response: requests.Response) -> str:
    """The error message of Triton's HTTP answer (``{"error": message}``), or its whole text."""
    try:
        return str(response.json()["error"])
    except (ValueError, KeyError, TypeError):
        return response.text


def openai_error_outcome(exc) -> tuple[str, str]:
    """An error the OpenAI SDK raised, by the code of the OpenAI body (the contract's table): only overloaded is
    expected."""
    if getattr(exc, "code", None) == errors.HTTP[ErrorKind.OVERLOADED].code:
        return "error", OVERLOADED[ErrorKind.OVERLOADED]
    return "lost", f"unexpected error: {exc}"


def stream_outcome(stream: GrpcStream, request: Request, timeout: float, expected=None) -> tuple[str, str]:
    """The outcome of a request read by a :class:`GrpcStream` that was waited on for ``timeout`` s."""
    if not stream.final:
        return "lost", f"no final response within {timeout:g} s ({len(stream.chunks)} responses before)"
    if stream.error is not None:
        return error_outcome(stream.error, expected)
    return answer_outcome(len(stream.token_ids), stream.finish_reason, request.max_tokens)


def answer_outcome(num_tokens: int, finish_reason: str | None, max_tokens: int) -> tuple[str, str]:
    if num_tokens != max_tokens or finish_reason != "length":
        return "lost", f"wrong answer: {num_tokens} of {max_tokens} tokens, finish reason {finish_reason!r}"
    return "completed", ""


# ---- the patterns ---------------------------------------------------------------------------------------------


def fresh_stream_cancel_after_final(client: Client) -> None:
    """A gRPC stream of its own per request, closed with ``stop_stream(cancel_requests=True)`` once the final
    response is in: a cancel that arrives after the answer is complete."""
    target = client.target
    for index in client.requests():
        request = client.request(index)
        stream = start_stream(target.grpc_url, client.model, request.prompt, **request.values)
        stream.wait(target.request_timeout)
        stream.close(cancel=True)
        client.account(*stream_outcome(stream, request, target.request_timeout))


class ClientSession:
    """A client's requests sent in turn on one gRPC stream (a :class:`StreamSession`), each waited for and accounted.
    A request still open after the request timeout (lost) is cancelled with its stream, and a new stream carries the
    next; ``with`` closes the last one."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.session = StreamSession(client.target.grpc_url)

    def send(self, request: Request, expected=None, lost_context: str = "", **sequence) -> None:
        """Send ``request`` (``sequence``: tritonclient's sequence keywords), wait for it, and account its outcome
        (``expected``: the errors it may end with, as :func:`error_outcome` takes them; ``lost_context``: put in
        front of the reason when it is lost)."""
        client, timeout = self.client, self.client.target.request_timeout
        stream = self.session.send(client.model, client.tensors(request), **sequence)
        stream.wait(timeout)
        outcome, reason = stream_outcome(stream, request, timeout, expected)
        client.account(outcome, lost_context + reason if outcome == "lost" else reason)
        if not self.session.idle:
            self.session.close(cancel=True)
            self.session = StreamSession(client.target.grpc_url)

    def __enter__(self) -> "ClientSession":
        return self

    def __exit__(self, *exc_info) -> None:
        self.session.close(cancel=not self.session.idle)


def long_lived_stream(client: Client) -> None:
    """One gRPC stream for all of the client's requests, sent in turn and never cancelled."""
    with ClientSession(client) as session:
        for index in client.requests():
            session.send(client.request(index))


def cancel_mid_stream(client: Client) -> None:
    """A long streamed answer cancelled (``stop_stream(cancel_requests=True)``) after 0 to 8 of its tokens."""
    target = client.target
    for _ in client.requests():
        request = client.long_request()
        stream = start_stream(target.grpc_url, client.model, request.prompt, **request.values)
        try:
            num_tokens = client.rng.randint(0, MAX_CANCEL_AFTER)
            arrived = stream.wait_tokens(num_tokens, target.request_timeout)
            if stream.final:  # it ended before the cancel: an error, most likely
                outcome = stream_outcome(stream, request, target.request_timeout)
            elif arrived:
                stream.cancel()
                outcome = ("cancelled", "")
            else:
                outcome = ("lost", f"{len(stream.chunks)} of {num_tokens} tokens within {target.request_timeout:g} s")
        finally:
            stream.close(cancel=not stream.final)
        client.account(*outcome)


def post_generate(client: Client, body: dict, lost_context: str = "") -> requests.Response | None:
    """The answer of the model's HTTP ``/generate`` to ``body``; None, the request accounted as lost (``lost_context``
    in front of the reason), when none came within the request timeout."""
    target = client.target
    try:
        return requests.post(f"{target.http_url}/v2/models/{client.model}/generate", json=body,
                             timeout=target.request_timeout)
    except requests.Timeout:
        client.account("lost", f"{lost_context}no response within {target.request_timeout:g} s")
        return None


def http_generate(client: Client) -> None:
    """HTTP ``/v2/models/M/generate``, waited on to the end."""
    for index in client.requests():
        request = client.request(index)
        body = {"text_input": request.prompt, **request.values}
        del body["stream"]
        response = post_generate(client, body)
        if response is None:
            continue
        if response.status_code != 200:
            client.account(*error_outcome(http_error(response)))
            continue
        answer = response.json()
        client.account(*answer_outcome(answer.get("num_output_tokens", -1), answer.get("finish_reason"),
                                       request.max_tokens))


def http_generate_stream_drop(client: Client) -> None:
    """HTTP ``/v2/models/M/generate_stream`` (server-sent events), the connection closed after 0 to 8 events."""
    target = client.target
    for _ in client.requests():
        request = client.long_request()
        body = {"text_input": request.prompt, **request.values}
        wanted = client.rng.randint(0, MAX_CANCEL_AFTER)
        try:
            with requests.post(f"{target.http_url}/v2/models/{client.model}/generate_stream", json=body,
                               stream=True, timeout=target.request_timeout) as response:
                if response.status_code != 200:
                    client.account(*error_outcome(http_error(response)))
                    continue
                outcome = ("cancelled", "")  # leaving the block closes the connection
                lines, num_events = response.iter_lines(), 0
                while num_events < wanted:
                    line = next(lines, None)
                    if line is None:
                        outcome = ("lost", f"the stream ended after {num_events} of {request.max_tokens} events")
                        break
                    if line.startswith(b"data:"):
                        event = json.loads(line[len(b"data:"):])
                        if "error" in event:
                            outcome = error_outcome(event["error"])
                            break
                        num_events += 1
        except requests.Timeout:
            outcome = ("lost", f"no event within {target.request_timeout:g} s")
        client.account(*outcome)


def openai_stream_disconnect(client: Client) -> None:
    """The OpenAI SDK streaming completions from the OpenAI frontend: two requests in three disconnect after 0 to 8
    chunks, the third is read to its end (its usage must say max_tokens)."""
    import openai  # NOTE: here, not at the top: only this pattern needs the SDK

    target = client.target
    if target.openai_url is None:
        raise RuntimeError("the OpenAI frontend is not running")
    sdk = openai.OpenAI(base_url=f"{target.openai_url}/v1", api_key="unused", max_retries=0,
                        timeout=target.request_timeout)
    try:
        for index in client.requests():
            whole = index % 3 == 2
            request = client.request(index) if whole else client.long_request()
            try:
                stream = sdk.completions.create(
                    model=client.model, prompt=request.prompt, max_tokens=request.max_tokens, temperature=0.0,
                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                with stream:
                    if whole:
                        outcome = openai_answer(stream, request)
                    else:
                        wanted = client.rng.randint(0, MAX_CANCEL_AFTER)
                        num_chunks = sum(1 for _ in itertools.islice(stream, wanted))
                        outcome = ("cancelled", "")  # leaving the block closes the connection
                        if num_chunks < wanted:
                            outcome = ("lost", f"the stream ended after {num_chunks} of {request.max_tokens} chunks")
            except openai.APITimeoutError:
                outcome = ("lost", f"no response within {target.request_timeout:g} s")
            except openai.APIError as exc:  # a refusal (429: overloaded), or an error event in the stream
                outcome = openai_error_outcome(exc)
            client.account(*outcome)
    finally:
        sdk.close()


def openai_answer(stream, request: Request) -> tuple[str, str]:
    finish_reason, num_tokens = None, -1
    for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish_reason = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            num_tokens = chunk.usage.completion_tokens
    return answer_outcome(num_tokens, finish_reason, request.max_tokens)


SEQUENCE_IDS = itertools.count(1)  # correlation ids, unique in the process (0 means none)


def perf_analyzer_sequences(client: Client) -> None:
    """perf_analyzer's sequence requests on one gRPC stream per client: by turns a sequence of one request (START
    and END on it, ``--sequence-length 1``) and one of 2 to ``sequence_length`` requests (START on the first, END on
    the last, as its default ``--sequence-length 20`` sends), each request sent when the one before it has ended."""
    with ClientSession(client) as session:
        for num_sequences in itertools.count():
            single = (client.index + num_sequences) % 2 == 0
            length = 1 if single else client.rng.randint(2, max(2, client.target.sequence_length))
            granted = client.take(length)
            if granted == 0:
                return
            sequence_id = next(SEQUENCE_IDS)
            for position in range(granted):
                request = client.request(client.index + client.num_sent - granted + position)
                session.send(request, SEQUENCE_REFUSALS, f"request {position + 1} of a sequence of {granted}: ",
                             sequence_id=sequence_id, sequence_start=position == 0,
                             sequence_end=position == granted - 1)


def bad_requests(client: Client) -> None:
    """HTTP ``/generate`` requests the model must refuse with a 400 that names the problem, one kind after another."""
    for _ in client.requests():
        name, body, kind, param = client.rng.choice(BAD_REQUESTS)
        response = post_generate(client, body, lost_context=f"{name}: ")
        if response is None:
            continue
        error = errors.parse(http_error(response))
        if response.status_code == 400 and error is not None and (error.kind, error.param) == (kind, param):
            client.account("error", f"bad request: {name}")
        else:
            outcome, reason = error_outcome(http_error(response))
            client.account(outcome, reason if outcome == "error" else f"{name}: HTTP {response.status_code}: {reason}")


# ---- after a cell ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def seats(http_url: str, model: str) -> int:
    """The requests ``model`` runs at once: its engine's ``max_num_seqs`` from the config the server serves (every
    shipped model has 8), else its ``max_batch_size``."""
    config = requests.get(f"{http_url}/v2/models/{model}/config", timeout=30).json()
    return max_num_seqs(config) or max(1, int(config.get("max_batch_size", 0)))


def full_batch(target: Target, model: str) -> tuple[int, int]:
    """(answered, sent): one one-token request for each of ``model``'s seats, all at once, each on a stream of its
    own, and how many were answered within the request timeout. A model that kept a seat (a sequence slot, a batch
    place) for a request that is gone answers fewer: a request after the one that leaked it would be lost."""
    size = seats(target.http_url, model)
    request = Request("a full batch", 1, stream=False)
    streams = [start_stream(target.grpc_url, model, request.prompt, **request.values) for _ in range(size)]
    deadline = time.monotonic() + target.request_timeout
    for stream in streams:
        stream.wait(max(0.0, deadline - time.monotonic()))
    for stream in streams:
        stream.close(cancel=not stream.final)
    answered = sum(stream_outcome(s, request, target.request_timeout)[0] == "completed" for s in streams)
    return answered, size


PATTERNS: dict[str, Callable[[Client], None]] = {
    pattern.__name__: pattern
    for pattern in (
        fresh_stream_cancel_after_final,
        long_lived_stream,
        cancel_mid_stream,
        http_generate,
        http_generate_stream_drop,
        openai_stream_disconnect,
        perf_analyzer_sequences,
        bad_requests,
    )
}
