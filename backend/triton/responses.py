"""Responses: what one engine output means for a Triton request (a streamed delta, or the whole text at the end),
and error responses. Every request gets exactly one response flagged final."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend.engine.llm_engine import RequestOutput
from backend.engine.request import FinishReason


@dataclass
class OpenRequest:
    """A request the server has accepted and not yet answered finally. Used only by the thread that sends."""

    sender: Any
    stream: bool
    arrival: float = field(default_factory=time.perf_counter)
    omitted_outputs: frozenset[str] = frozenset()
    text: list[str] = field(default_factory=list)  # non-streaming: the whole text, sent at the end
    token_ids: list[int] = field(default_factory=list)


class OpenRequests:
    """The requests a model accepted and has not answered finally, by request id: the one place that sends.

    ``send`` is the engine's sink (it runs on the thread that drives the engine); ``add`` and ``cancelled`` may run
    on any thread.
    """

    def __init__(self, pb, metrics, batched: bool) -> None:
        self._pb = pb
        self._metrics = metrics
        self._batched = batched  # a model with max_batch_size > 0 answers with a batch dimension
        self._open: dict[str, OpenRequest] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._open)

    def add(self, request_id: str, open_request: OpenRequest) -> None:
        with self._lock:
            self._open[request_id] = open_request

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
            self._open.pop(request_id, None)

    def send(self, output: RequestOutput) -> None:
        """Send what ``output`` means for its request; a final output closes the request (and is counted)."""
        with self._lock:
            if output.finished:
                open_request = self._open.pop(output.request_id, None)
            else:
                open_request = self._open.get(output.request_id)
        if open_request is None:
            return
        if output.finished and output.finish_reason != FinishReason.REFUSED:
            self._metrics.on_finished(output, open_request.arrival)
        send_output(self._pb, open_request, output, self._batched)

    def forget(self, output: RequestOutput) -> None:
        """Close a request without sending (Triton has let go of it: nothing may be sent); it is still counted."""
        with self._lock:
            open_request = self._open.pop(output.request_id, None)
        if open_request is not None and output.finished:
            self._metrics.on_finished(output, open_request.arrival)

    def cancelled(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Those of ``request_ids`` (default: every open request) whose client cancelled. NOTE: ``is_cancelled()``
        is an IPC round trip (~35 us) per request. It is asked under the lock, so a request that another thread closes
        and answers meanwhile (a refusal in execute()) is never asked after its final response: asking then crashed
        tritonserver 2.51 (Signal 11 in TRITONBACKEND_ResponseFactoryIsCancelled) during a burst of refusals."""
        with self._lock:
            candidates = list(self._open.items()) if request_ids is None else \
                [(rid, self._open[rid]) for rid in request_ids if rid in self._open]
            return [rid for rid, r in candidates if r.sender.is_cancelled()]


class CancellationPoll:
    """Which requests' clients cancelled, asked of the server at most every ``streaming_every`` seconds for the
    requests being stepped and every ``all_every`` for every open one; between polls the answer is empty.

    NOTE: each ``is_cancelled()`` is an IPC round trip (~35 us) on the thread that steps the engine. Asked every step
    for every running request, that was 1.2 ms of a 34 ms step at 32 sequences. Polled every 0.2 s it costs a sixth
    of that, and an abort takes effect within 0.2 s and one step: a few steps of one sequence's share.
    The responses themselves cannot leave that thread: sent from several threads at once, tritonserver 2.51 crashed
    (Signal 11); sent from one other thread while the engine stepped, they competed with the forward for the two
    cores (50 ms steps instead of 40 at 32 sequences).
    """

    def __init__(self, open_requests: OpenRequests, streaming_every: float = 0.2, all_every: float = 1.0) -> None:
        self._open = open_requests
        self._streaming_every, self._all_every = streaming_every, all_every
        self._next_streaming = self._next_all = 0.0

    def __call__(self, request_ids: Iterable[str]) -> list[str]:
        """The cancelled ones among ``request_ids`` (those being stepped), or among every open request when that
        poll is due; [] when no poll is due."""
        now = time.monotonic()
        if now >= self._next_all:
            self._next_all, self._next_streaming = now + self._all_every, now + self._streaming_every
            return self._open.cancelled()
        if now >= self._next_streaming:
            self._next_streaming = now + self._streaming_every
            return self._open.cancelled(request_ids)
        return []


def send_output(pb, open_request: OpenRequest, output: RequestOutput, batched: bool) -> None:
    """Send what one engine output means for this request: a delta (streaming), or the whole text at the end."""
    flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if output.finished else 0
    if output.error is not None:
        error = pb.InferenceResponse(output_tensors=[], error=pb.TritonError(output.error))
        open_request.sender.send(error, flags=flags)
        return
    if open_request.stream:
        text, token_ids = output.delta_text, output.new_token_ids
    else:
        open_request.text.append(output.delta_text)
        open_request.token_ids += output.new_token_ids
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
