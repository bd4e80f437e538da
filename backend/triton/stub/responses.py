"""Responses: what one engine output means for a Triton request (a streamed delta, or the whole text at the end),
and error responses. Every request gets exactly one response flagged final.

A stream's tokens may be held for a few steps and sent together (``stream_interval``, in
backend/triton/stub/stream_interval.py); its first token and its final response always go out at once. An intermediate
response carries only the new text and token ids (``INTERMEDIATE_OUTPUTS``); the counts and the finish reason come
in the final one, or in every response when the request asks for them (``return_*: true``). ``logprobs`` (only when
asked) is vllm_backend's: a JSON list, one entry per token of the response, ``{token_id: {"logprob", "rank",
"decoded_token"}}`` with the sampled token first. ``prompt_logprobs`` (only when ``sampling_parameters`` asks) is
vLLM's ``prompt_logprobs`` in the same JSON, one entry per prompt token, the prompt token first and the first entry
``null``: sent once, in the request's first response.

A request with ``n`` > 1 gets each of its n sequences' text in responses of its own, each carrying the sequence's
``index`` (OpenAI's ``choices[i].index``): streamed, the deltas of all n interleaved as they are made; not streamed,
each sequence's whole text when it ends. A sequence's last response has its ``finish_reason``; the request's last one
is flagged final."""

from __future__ import annotations

import heapq
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend.contract import io_schema
from backend.contract.priority import DEFAULT_PRIORITY_LEVEL
from backend.contract.stop_board import StopBoard
from backend.engine.llm_engine import RequestOutput
from backend.engine.request import FinishReason
from backend.triton.stub.stream_interval import StreamPacer, StreamState

ALL_OUTPUTS = frozenset(io_schema.OUTPUT_NAMES)
# What every intermediate response of a stream carries; the other outputs only when asked for (``return_*: true``).
INTERMEDIATE_OUTPUTS = frozenset({"text_output", "output_ids"})
# Outputs in no response unless the request asked for them.
OPT_IN_OUTPUTS = frozenset({"logprobs", "prompt_logprobs"})


@dataclass
class OpenRequest:
    """A request the server has accepted and not yet answered finally. Used only by the thread that sends."""

    sender: Any
    stream: bool
    arrival: float = field(default_factory=time.perf_counter)
    omitted_outputs: frozenset[str] = frozenset()  # turned off (return_*: false): in no response
    requested_outputs: frozenset[str] = frozenset()  # asked for (return_*: true): in every response
    n: int = 1  # sequences: with more than one, every response carries its ``index``
    priority: int = DEFAULT_PRIORITY_LEVEL  # Triton's level: the metrics' priority label
    client_id: str = ""  # the id its client gave Triton (the stop board's name for it); "" when none
    # Made and not yet sent, by sequence index: texts, token ids and (when asked) log-probabilities, one per token
    # (non-streaming: the whole text).
    held: dict[int, tuple[list[str], list[int], list[dict]]] = field(default_factory=dict)
    pacing: StreamState | None = None  # a stream, once its first token went out
    # The prompt's log-probabilities (the request's first output has them when asked) until a response carries them
    prompt_logprobs: list[dict | None] | None = None

    def hold(self, output: RequestOutput) -> None:
        text, token_ids, logprobs = self.held.setdefault(output.index, ([], [], []))
        text.append(output.delta_text)
        token_ids += output.new_token_ids
        logprobs += output.logprobs or ()
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs

    def take(self, index: int) -> tuple[str, list[int], list[dict]]:
        """Everything held for sequence ``index``, to be sent now."""
        text, token_ids, logprobs = self.held.pop(index, ((), [], []))
        return "".join(text), token_ids, logprobs


class OpenRequests:
    """The requests a model accepted and has not answered finally, by request id: the one place that sends.

    ``send`` is the engine's sink (it runs on the thread that drives the engine); ``add``, ``cancelled`` and
    ``stopped`` may run on any thread.
    """

    def __init__(self, pb, metrics, batched: bool, pacer: StreamPacer | None = None,
                 stop_board: StopBoard | None = None) -> None:
        self._pb = pb
        self._metrics = metrics
        self._batched = batched  # a model with max_batch_size > 0 answers with a batch dimension
        self.pacer = pacer or StreamPacer()
        self.stop_board = stop_board
        self._open: dict[str, OpenRequest] = {}
        self._by_client_id: dict[str, str] = {}  # client id -> request id, for the open requests that have one
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._open)

    def add(self, request_id: str, open_request: OpenRequest) -> None:
        with self._lock:
            self._open[request_id] = open_request
            if open_request.client_id:
                self._by_client_id[open_request.client_id] = request_id

    def _close(self, request_id: str) -> OpenRequest | None:
        """Under the lock: the request leaves the open ones."""
        open_request = self._open.pop(request_id, None)
        if open_request is not None and self._by_client_id.get(open_request.client_id) == request_id:
            del self._by_client_id[open_request.client_id]
        return open_request

    def rebind(self, request_id: str, sender) -> bool:
        """Send from now on through ``sender`` (iterative batching: each iteration hands the model a new request
        object); false if the request is no longer open."""
        with self._lock:
            open_request = self._open.get(request_id)
            if open_request is not None:
                open_request.sender = sender
        return open_request is not None

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._close(request_id)

    def send(self, output: RequestOutput) -> None:
        """Send what ``output`` means for its request, now or with the stream's next response (the pacer says); a
        final output closes the request (and is counted)."""
        with self._lock:
            if output.finished:
                open_request = self._close(output.request_id)
            else:
                open_request = self._open.get(output.request_id)
        if open_request is None:
            return
        if output.finished and output.finish_reason != FinishReason.REFUSED:
            self._metrics.on_finished(output, open_request.arrival, open_request.priority)
        elif output.finish_reason is not None and not output.finished:
            self._metrics.on_sequence_finished(output)
        if output.finish_reason is not None or output.finished or output.error is not None or \
                not open_request.stream:
            send_output(self._pb, open_request, output, self._batched)
        elif open_request.pacing is None:  # the first token: at once
            open_request.pacing = self.pacer.start()
            send_output(self._pb, open_request, output, self._batched)
        elif self.pacer.due(open_request.pacing):
            self.pacer.timed(lambda: send_output(self._pb, open_request, output, self._batched))
        else:
            open_request.hold(output)

    def end_step(self) -> None:
        """A step's outputs are all sent (on the thread that sends): the pacer chooses the next interval."""
        self.pacer.end_step()

    def forget(self, output: RequestOutput) -> None:
        """Close a request without sending (Triton has let go of it: nothing may be sent); it is still counted."""
        with self._lock:
            open_request = self._close(output.request_id)
        if open_request is not None and output.finished:
            self._metrics.on_finished(output, open_request.arrival, open_request.priority)

    def cancelled(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Those of ``request_ids`` (default: every open request) whose client cancelled. NOTE: ``is_cancelled()``
        is an IPC round trip (~35 us) per request. It is asked under the lock, so a request that another thread closes
        and answers meanwhile (a refusal in execute()) is never asked after its final response: asking then crashed
        tritonserver 2.51 (Signal 11 in TRITONBACKEND_ResponseFactoryIsCancelled) during a burst of refusals
        (triton_workarounds.CANCEL_CHECK_AFTER_FINAL)."""
        with self._lock:
            candidates = list(self._open.items()) if request_ids is None else \
                [(rid, self._open[rid]) for rid in request_ids if rid in self._open]
            return [rid for rid, r in candidates if r.sender.is_cancelled()]

    def stopped(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Those of ``request_ids`` (default: every open request) posted on the stop board: their client asked
        to end them without cancelling (``backend/contract/stop_board.py``). They get their final response like any
        other request. One directory read; nothing asked of the server."""
        posted = self.stop_board.posted() if self.stop_board is not None else ()
        if not posted:
            return []
        with self._lock:
            stopped = [self._by_client_id[cid] for cid in posted if cid in self._by_client_id]
        if request_ids is None:
            return stopped
        asked = set(request_ids)
        return [rid for rid in stopped if rid in asked]


class CancellationPoll:
    """Which requests' clients cancelled, asked of the server within a budget of the stepping thread's time.

    - Before each step the requests being stepped are asked round-robin (longest unasked first), as many as
      ``budget`` (a fraction of the time since the last poll) pays for at the measured cost of one ask;
    - each of them is asked at least every ``streaming_every`` seconds whatever the budget;
    - every open request (waiting ones too) every ``all_every`` seconds.
    Between polls the answer is empty; ``budget=0`` leaves the two timers alone.

    NOTE: each ``is_cancelled()`` is an IPC round trip (~35 us) on the thread that steps the engine. Asked every step
    for every running request, that was 1.2 ms of a 34 ms step at 32 sequences. The budget bounds that cost, not the
    number of requests: at 1 % a 25 ms step pays for about 7 asks, so up to 7 running requests are each asked before
    every step (a client that goes away has its KV blocks back after one step, not after up to 0.2 s), and 32 are
    each asked every 5 steps or so; the cost stays near 1 % of the loop's time however large the batch, where the
    timer alone cost 2.6 % at 151 sequences and nothing at one.
    The responses themselves cannot leave that thread: sent from several threads at once, tritonserver 2.51 crashed
    (Signal 11; triton_workarounds.SINGLE_SENDER); sent from one other thread while the engine stepped, they competed
    with the forward for the two cores (50 ms steps instead of 40 at 32 sequences).
    """

    ASK_COST_S = 35e-6  # one is_cancelled() until measured

    def __init__(self, open_requests: OpenRequests, budget: float = 0.01, streaming_every: float = 0.2,
                 all_every: float = 1.0, clock: Callable[[], float] | None = None) -> None:
        self._open = open_requests
        self._clock = clock or time.monotonic
        self._budget, self._streaming_every, self._all_every = budget, streaming_every, all_every
        self._next_streaming = self._next_all = 0.0
        self._last_poll: float | None = None
        self._credit = 0.0  # seconds of asking earned and not yet spent
        self._ask_cost = self.ASK_COST_S
        self._asked_at: dict[str, float] = {}

    def __call__(self, request_ids: Iterable[str]) -> list[str]:
        """The open requests posted on the stop board (every time: it costs one directory read), and the cancelled
        ones among ``request_ids`` (those being stepped) that were asked now, or among every open request when that
        poll is due."""
        stopped = self._open.stopped()
        cancelled = self._cancelled(request_ids)
        return stopped + [rid for rid in cancelled if rid not in stopped] if stopped else cancelled

    def _cancelled(self, request_ids: Iterable[str]) -> list[str]:
        now = self._clock()
        since, self._last_poll = (0.0 if self._last_poll is None else now - self._last_poll), now
        if now >= self._next_all:
            self._next_all, self._next_streaming = now + self._all_every, now + self._streaming_every
            return self._open.cancelled()
        ids = list(request_ids)
        due = now >= self._next_streaming  # the guarantee, paid whatever the budget
        if due:
            self._next_streaming = now + self._streaming_every
            chosen = ids
        else:
            self._credit = min(self._credit + self._budget * since, self._budget * self._streaming_every)
            affordable = min(int(self._credit / self._ask_cost), len(ids))
            chosen = ids if affordable == len(ids) else \
                heapq.nsmallest(affordable, ids, key=lambda rid: self._asked_at.get(rid, 0.0))
        if not chosen:
            return []
        cancelled = self._open.cancelled(chosen)
        spent = self._clock() - now
        if not due:
            self._credit = max(self._credit - spent, 0.0)
        if spent > 0:
            self._ask_cost = 0.8 * self._ask_cost + 0.2 * spent / len(chosen)
        for rid in chosen:
            self._asked_at[rid] = now
        if len(self._asked_at) > 2 * len(ids) + 64:  # forget the requests that have left
            self._asked_at = {rid: self._asked_at[rid] for rid in ids if rid in self._asked_at}
        return cancelled


def send_output(pb, open_request: OpenRequest, output: RequestOutput, batched: bool) -> None:
    """Send what one engine output means for this request, with whatever was held before it for its sequence: a
    delta (streaming), or the sequence's whole text at its end."""
    flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if output.finished else 0
    if output.error is not None:
        error = pb.InferenceResponse(output_tensors=[], error=pb.TritonError(output.error))
        open_request.sender.send(error, flags=flags)
        return
    open_request.hold(output)
    ended = output.finished or output.finish_reason is not None  # the sequence's last response
    if not (open_request.stream or ended):
        return
    text, token_ids, logprobs = open_request.take(output.index)
    if ended:
        omitted = open_request.omitted_outputs | (OPT_IN_OUTPUTS - open_request.requested_outputs)
    else:  # NOTE: each tensor is a shared-memory allocation and a bigger IPC message: the fewest that say it all
        omitted = ALL_OUTPUTS - INTERMEDIATE_OUTPUTS - open_request.requested_outputs
    if open_request.n == 1:  # one sequence: its index says nothing
        omitted |= {"index"}
    else:
        omitted -= {"index"}
    prompt_logprobs, open_request.prompt_logprobs = open_request.prompt_logprobs, None  # in one response only
    omitted = omitted | {"prompt_logprobs"} if prompt_logprobs is None else omitted - {"prompt_logprobs"}
    tensors = make_output_tensors(pb, text, token_ids, output, batched, omitted, logprobs, prompt_logprobs)
    open_request.sender.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)


def make_output_tensors(
    pb, text: str, token_ids: list[int], output: RequestOutput, batched: bool, omitted: frozenset[str] = frozenset(),
    logprobs: list[dict] = (), prompt_logprobs: list[dict | None] | None = None,
) -> list:
    lead = (1,) if batched else ()  # a model with max_batch_size > 0 answers with a batch dimension
    reason = output.finish_reason or ""
    arrays = {  # built only for the outputs sent
        "text_output": lambda: np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": lambda: np.array(token_ids, dtype=np.int32),
        "index": lambda: np.array([output.index], dtype=np.int32),
        "finish_reason": lambda: np.array([(reason or "").encode()], dtype=np.object_),
        "num_input_tokens": lambda: np.array([output.num_prompt_tokens], dtype=np.int32),
        "num_output_tokens": lambda: np.array([output.num_output_tokens], dtype=np.int32),
        "logprobs": lambda: np.array([logprobs_json(logprobs).encode()], dtype=np.object_),
        "prompt_logprobs": lambda: np.array([logprobs_json(prompt_logprobs or []).encode()], dtype=np.object_),
    }
    return [pb.Tensor(name, make().reshape(lead + (-1,))) for name, make in arrays.items() if name not in omitted]


def logprobs_json(logprobs: list[dict | None]) -> str:
    """vllm_backend's ``logprobs`` output for these tokens (a token without any, the prompt's first: ``null``)."""
    return json.dumps([None if ranked is None else
                       {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                        for tid, lp in ranked.items()} for ranked in logprobs])


# NOTE: error responses carry Triton's default code: a decoupled model's errors reach clients as text only (gRPC
# stream error_message; HTTP /generate answers 400 to every model error in 2.51), so the message says it all:
# triton_workarounds.ERROR_IS_A_MESSAGE.
def send_error(pb, sender, message: str) -> None:
    sender.send(
        pb.InferenceResponse(output_tensors=[], error=pb.TritonError(message)),
        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    )
