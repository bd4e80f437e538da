"""Requests that end a client's own sequence, served by the iterative model through a copy without the sequence.

perf_analyzer (and genai-perf, which drives it) sends every request to a sequence-batched model as a sequence of its
own: a correlation id with the START and END flags (triton_workarounds.CLIENT_SEQUENCE_RELAY). Triton 2.51's
iterative sequence batcher closes such a sequence when it schedules the request, so the model cannot hand it back for
its next iteration: the rescheduled request is refused ("must specify the START flag on the first request of the
sequence") and its client never gets an answer.

:class:`SequenceRelay` serves such a request through a copy of itself that carries no sequence (the same inputs and
outputs, sent to the same model over BLS) and a sequence of the relay's own: START alone, with a correlation id from
the top half of the 64-bit range. Not Triton's own numbering (the one it gives requests without an id counts from 1,
as clients' ids do): releasing the client's request ends the client's id once more, which would end a copy that had
the same number. The iterative batcher then decides the copy's batch at every step like any other's; every response
of the copy goes back to the client's stream, and its final flag ends the client's request. A relayed request costs
one more hop per response inside the server; requests without sequence flags are not relayed.

A client sequence of several requests cannot be served that way (the second request would need the first's KV
blocks): its second request is answered at once with :data:`MULTI_REQUEST_SEQUENCE`, which says what to send instead.

NOTE: releasing the client's request makes Triton 2.51 log "sequence_utils.cc ... must specify the START flag" once
(it closes the sequence again with a request of its own, which it has already closed); nothing is lost.

The relay also sends the model's own request that closes a sequence whose slot Triton would otherwise keep
(:meth:`SequenceRelay.close_sequence`): the same way in, BLS to the same model with a correlation id.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading

import numpy as np

from backend.contract import errors
from backend.contract.errors import ErrorKind

# The sequence controls of config.pbtxt (control_input): what the relayed copy must not carry.
CONTROL_INPUTS = ("CORRID", "START", "END")
# The request parameter that marks the model's own request that closes a sequence (SequenceRelay.close_sequence).
CLOSES_SEQUENCE = "llm_closes_sequence"
# The copies' correlation ids: far from the ids clients and Triton's own numbering use (both count from 1).
FIRST_RELAY_ID = 1 << 63
# The error of a request whose client cancelled it, where llm_iterative answers it rather than Triton: a relayed
# one, or one Triton handed back cancelled.
CANCELLED = errors.message(ErrorKind.CANCELLED, "the request was cancelled")
# llm_iterative's answer to the second request of a client sequence (the module's docstring).
MULTI_REQUEST_SEQUENCE = errors.message(
    ErrorKind.MULTI_REQUEST_SEQUENCE,
    "llm_iterative serves one request per client sequence (Triton 2.51's iterative sequence batcher closes a sequence "
    "when its first request is done): send each request as a sequence of its own, with START and END, or with no "
    "sequence id (perf_analyzer --sequence-length 1; genai-perf: add -- --sequence-length 1)"
)

log = logging.getLogger(__name__)


def flag(pb_utils, request, name: str) -> bool:
    """A boolean sequence control of ``request`` (absent: false)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tensor is not None and bool(tensor.as_numpy().item())


class SequenceRelay:
    """Serves requests whose client sequence ends with them through a flagless copy sent to ``model_name``."""

    def __init__(self, pb_utils, model_name: str) -> None:
        self.pb_utils = pb_utils
        self.model_name = model_name
        self._ids = itertools.count(FIRST_RELAY_ID)
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def ends_client_sequence(self, request) -> bool:
        """True for a request that carries its client's END flag: Triton cannot reschedule it."""
        return flag(self.pb_utils, request, "END")

    def forward(self, request) -> None:
        """Send the copy now and pass its responses to ``request``'s sender on a thread of its own; the caller
        releases ``request`` (RELEASE_ALL) as execute() returns."""
        pb = self.pb_utils
        sender = request.get_response_sender()
        inputs = [tensor for tensor in request.inputs() if tensor.name() not in CONTROL_INPUTS]
        copy = pb.InferenceRequest(model_name=self.model_name, inputs=inputs,
                                   requested_output_names=sorted(request.requested_output_names()),
                                   correlation_id=next(self._ids), flags=pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
        self._start(self._pass_on, copy, sender)

    def close_sequence(self, correlation_id: int) -> None:
        """Send a request of the model's own on the sequence ``correlation_id``, on a thread of its own, so that
        Triton frees the slot it may still keep for it: the model calls this for a request whose client cancelled it
        while Triton held it (the iteration book's docstring says why the slot can stay taken). It carries START:
        Triton ends the sequence that holds the slot ("has a conflict ... terminated early", a warning in its log),
        gives the slot to this request, and frees it once execute() has answered and released it
        (``IterationBook.hand_in``); for a sequence Triton had already ended, it is a new one, answered the same way.
        NOTE: START, not END nor a plain request: released, those left the slot taken in Triton 2.51, an END's for
        good (its next sequence never ran)."""
        pb = self.pb_utils
        text = pb.Tensor("text_input", np.array([[b"close"]], dtype=np.object_))  # never read
        request = pb.InferenceRequest(model_name=self.model_name, inputs=[text], requested_output_names=[],
                                      correlation_id=correlation_id, flags=pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
                                      parameters={CLOSES_SEQUENCE: True})
        self._start(self._close, request, correlation_id)

    def closes_sequence(self, request) -> bool:
        """True for a request :meth:`close_sequence` sent (read only from one that starts a sequence)."""
        return CLOSES_SEQUENCE in json.loads(request.parameters() or "{}")

    def _close(self, request, correlation_id: int) -> None:
        try:
            for response in request.exec(decoupled=True):
                if response.has_error():
                    log.warning("closing sequence %d: %s", correlation_id, response.error().message())
        except Exception:  # noqa: BLE001 (nobody waits for it; the server may be stopping)
            log.exception("closing sequence %d failed", correlation_id)

    def _start(self, target, *args) -> None:
        """Run ``target(*args)`` on a thread of its own, one that :meth:`join` waits for until it ends."""
        def run() -> None:
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name="sequence-relay", daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def _pass_on(self, copy, sender) -> None:
        pb = self.pb_utils
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            responses = copy.exec(decoupled=True)
            for response in responses:
                if sender.is_cancelled():
                    cancel = getattr(responses, "cancel", None)  # BLS cancellation, where the backend has it
                    if cancel is not None:
                        cancel()
                    error = pb.TritonError(CANCELLED)
                else:
                    error = response.error() if response.has_error() else None
                if error is not None:
                    sender.send(pb.InferenceResponse(error=error), flags=final)
                    for _ in responses:  # the copy runs to its end; nothing more reaches the client
                        pass
                    return
                outputs = response.output_tensors()
                if outputs:
                    sender.send(pb.InferenceResponse(output_tensors=outputs))
            sender.send(flags=final)
        except Exception as exc:  # noqa: BLE001 (the client must get its final response whatever failed here)
            log.exception("relaying a sequence request failed")
            try:
                failed = errors.message(ErrorKind.ENGINE_FAULT, f"relaying the request failed: {exc}")
                sender.send(pb.InferenceResponse(error=pb.TritonError(failed)), flags=final)
            except Exception:  # noqa: BLE001 (the sender is gone: final already sent, or the server stopping)
                pass

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the relays in flight (finalize)."""
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout)
