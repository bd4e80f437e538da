"""llm_iterative: Triton's iterative sequence batcher decides the batch at every iteration.

Each execute() gets the requests Triton batched now, new ones (START=1: admitted to the engine) and rescheduled ones
(found by the correlation id Triton gave them); the driver (``IterationDriver``, backend/engine/batching.py) runs
one engine step over exactly those and sends what it made; execute() hands the unfinished ones back with
RELEASE_RESCHEDULE. Their KV blocks stay in the paged cache between iterations. What every model shares (parsing,
the one place that sends, metrics, refusals, the shutdown notice) is ``ServedModel``.

perf_analyzer and genai-perf send a sequence model sequences of their own: a correlation id, START on the first
request, END on the last (``--sequence-length``, 20 by default). A request that carries START and END (one request per
sequence) cannot be handed back in Triton 2.51; ``SequenceRelay`` serves it through a copy without the client's
sequence, which Triton batches like any other. A sequence of several requests cannot be served: releasing its first
request closes it in Triton 2.51, which then refuses the third itself; the second, which would otherwise wait for
ever, is answered at once with an error that says what to send instead (``MULTI_REQUEST_SEQUENCE``).

Triton hands every request it holds back at its next iteration. One not handed back for
max_sequence_idle_microseconds is ended and its KV blocks freed (``IterationDriver``): if its client cancelled it
while it waited to be rescheduled, Triton answered it itself and nothing is sent (a second final response crashes
tritonserver 2.51); otherwise Triton dropped it, and its client gets an error that says the server lost it.
Measured: a client that cancels right after its final response (tritonclient's ``stop_stream(cancel_requests=True)``)
can do so before the model's release reaches Triton, which then keeps that sequence's slot until its idle reaper
frees it; with every slot held, new requests wait in Triton's backlog, and one that waited longer than the idle
time is ended by the reaper as soon as it gets a slot, so Triton refuses to reschedule it ("must specify the START
flag") and only the model can still answer it.
"""

import threading
import time

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import triton_python_backend_utils as pb_utils  # noqa: E402

from backend.engine.batching import IterationDriver  # noqa: E402
from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.triton.model_config import sequence_idle_seconds  # noqa: E402
from backend.triton.responses import send_error  # noqa: E402
from backend.triton.sequence_relay import SequenceRelay  # noqa: E402
from backend.triton.served_model import ServedModel  # noqa: E402

MULTI_REQUEST_SEQUENCE = (
    "llm_iterative serves one request per client sequence (Triton 2.51's iterative sequence batcher closes a sequence "
    "when its first request is done): send each request as a sequence of its own, with START and END, or with no "
    "sequence id (perf_analyzer --sequence-length 1; genai-perf: add -- --sequence-length 1)"
)


class TritonPythonModel(ServedModel, batching="iterative"):
    def start_engine(self, config):
        engine = LLMEngine(config)  # loaded on the thread that steps it: one OpenMP thread team
        reap_after = sequence_idle_seconds(self.model_config)
        self.driver = IterationDriver(engine, self.open.send, self.open.forget, reap_after,
                                      after_step=self.observe_steps, client_cancelled=self.open.cancelled)
        self.request_ids = {}  # Triton's correlation id -> engine request id, while the request is open
        self.reap_after = reap_after
        # Correlation ids whose request the driver ended while Triton held it (reaped, or every request ended by a
        # failure): Triton may still hand it back, and it must then be released unanswered. -> when
        self.let_go = {}
        self.gap = self.metrics.iteration_gap()
        self.released_at = None  # when the last execute() that handed requests back returned
        self.stopping = threading.Event()
        # The reaper answers requests Triton dropped; execute() sends too. NOTE: responses sent from two threads at
        # once crashed tritonserver 2.51 (backend/triton/responses.py), so they take turns.
        self.sending = threading.Lock()
        self.relay = SequenceRelay(pb_utils, self.name)
        threading.Thread(target=self._reaper, args=(reap_after,), name="reaper", daemon=True).start()
        return engine

    def execute(self, requests):
        with self.sending:
            return self._execute(requests)

    def _execute(self, requests):
        started = time.perf_counter()
        handed = {}  # engine request id -> this iteration's Triton request
        for request in requests:
            if self.relay.ends_client_sequence(request):
                self.relay.forward(request)
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
                continue
            correlation_id = int(pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy().item())
            if pb_utils.get_input_tensor_by_name(request, "START").as_numpy().item():
                self.let_go.pop(correlation_id, None)
                request_id = self.admit(request, started, self.driver.add)
            elif correlation_id not in self.request_ids and correlation_id not in self.let_go:
                # NOTE: not a hand-back (none of ours is open under this id): the next request of its client's own
                # sequence, after the one before it got its final response.
                send_error(pb_utils, request.get_response_sender(), MULTI_REQUEST_SEQUENCE)
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
                continue
            else:  # rescheduled; unknown once the driver ended it (its final response went out then)
                if self.released_at is not None:  # the hand-back: the last execute()'s end to this one's start
                    self.gap.observe(started - self.released_at)
                    self.released_at = None
                self.let_go.pop(correlation_id, None)
                request_id = self.request_ids.get(correlation_id)
                if request_id is not None and not self.open.rebind(request_id, request.get_response_sender()):
                    request_id = None
            if request_id is None or not self.driver.is_open(request_id):  # it got its final response
                self.request_ids.pop(correlation_id, None)
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
            else:
                self.request_ids[correlation_id] = request_id
                handed[request_id] = (correlation_id, request)

        unfinished = self.driver.iterate(handed, cancelled=self._cancelled, expired=self.shutdown.expired)
        if self.driver.fatal_error is not None and self.failure is None:  # every open request got its final error
            self.fail(self.driver.fatal_error)
        for request_id, (correlation_id, request) in handed.items():
            if request_id in unfinished:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            else:
                self.request_ids.pop(correlation_id, None)
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
        # Requests the driver ended while Triton held them (reaped: Triton let go of them; or a failure) are
        # forgotten, and remembered as let go until Triton's own idle timeout has surely ended their sequences.
        now = time.perf_counter()
        for correlation_id, request_id in list(self.request_ids.items()):
            if not self.driver.is_open(request_id):
                del self.request_ids[correlation_id]
                self.let_go[correlation_id] = now
        self.let_go = {c: t for c, t in self.let_go.items() if now - t < 2 * self.reap_after}
        self.released_at = time.perf_counter() if unfinished else None
        return None

    def _cancelled(self, request_ids):  # before the step, under the driver's lock
        self.count_joined()
        return self.open.cancelled(request_ids)

    def _reaper(self, period):
        while not self.stopping.wait(period):
            with self.sending:
                self.driver.reap()

    def finalize(self):
        self.stopping.set()
        self.relay.join(timeout=5.0)
        super().finalize()
