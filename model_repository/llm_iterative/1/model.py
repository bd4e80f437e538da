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

When a client's cancel reaches Triton decides what happens to the sequence's slot (Triton 2.51's sequence batcher):
- while the model holds the request: handed back (RELEASE_RESCHEDULE), Triton finds it cancelled in its queue,
  answers it itself (CANCELLED) and frees the slot at once;
- between a release and the next batch (in the queue that forms it), or after a release for good (RELEASE_ALL) that
  has not yet reached Triton: the slot stays taken until Triton's idle reaper (max_sequence_idle_microseconds, 30 s)
  frees it. With every slot taken, new requests wait in Triton's backlog, and one that waited longer than the idle
  time is ended by the reaper as soon as it gets a slot ("must specify the START flag" on the hand-back).
Clients cancel in answer to what they receive, so what an execute() makes for a request is sent when the model
holds it again (at the start of the next execute(), after the rebinds) or once it is released for good (then, or
SEND_AFTER_RELEASE_S after the return when no execute() comes sooner). Never while Triton holds it: Triton may have
answered it, and a send then crashes tritonserver 2.51. A request that ends in
an execute() and whose client has cancelled it is handed back instead of released, what it made dropped, for
Triton to answer. What remains, a cancel in the few milliseconds between a release and the next batch, costs that
slot the idle time.

Triton hands every request it holds back at its next iteration. One not handed back is ended and its KV blocks
freed (``IterationDriver``): if its client cancelled it while Triton held it, after CANCELLED_AFTER_S: Triton
answered it itself and nothing is sent (a second final response crashes tritonserver 2.51); otherwise, after
max_sequence_idle_microseconds, Triton dropped it, and its client gets an error that says the server lost it.

Triton 2.51 counts a sequence's idle time from its last request's arrival, and time in the backlog counts: a
request that waited there longer than max_sequence_idle_microseconds is force-ended as soon as it gets a slot (so
is one whose iteration took that long). The idle time (config.pbtxt) is therefore long, 30 s: it bounds the
backlog's wait. Its cost, a slot kept that long after a cancel that fell between a release and the next batch, is
rare. (At 5 s, 16 streams on 8 slots of a slow 2-core machine lost requests that waited in the backlog.)
"""

import threading
import time

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import triton_python_backend_utils as pb_utils  # noqa: E402

from backend.engine.batching import IterationDriver  # noqa: E402
from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.triton.stub.model_config import sequence_idle_seconds  # noqa: E402
from backend.triton.stub.responses import send_error  # noqa: E402
from backend.triton.stub.sequence_relay import CANCELLED, MULTI_REQUEST_SEQUENCE, SequenceRelay  # noqa: E402
from backend.triton.stub.served_model import ServedModel  # noqa: E402

# Time from execute()'s return to sending what it made, when no execute() comes sooner (the module's docstring).
SEND_AFTER_RELEASE_S = 0.005
# How long a request its client cancelled may go without being handed back before its KV blocks are freed: Triton
# answered it itself. Shorter than Triton's idle time (config.pbtxt), which bounds the backlog's wait instead.
CANCELLED_AFTER_S = 5.0


class TritonPythonModel(ServedModel, batching="iterative"):
    def start_engine(self, config):
        engine = LLMEngine(config)  # loaded on the thread that steps it: one OpenMP thread team
        reap_after = sequence_idle_seconds(self.model_config)
        self.driver = IterationDriver(engine, self._send, self.open.forget, reap_after,
                                      after_step=self.observe_steps, client_cancelled=self.open.cancelled,
                                      cancelled_after=CANCELLED_AFTER_S)
        self.request_ids = {}  # Triton's correlation id -> engine request id, while the request is open
        self.reap_after = reap_after
        # Correlation ids whose request the driver ended while Triton held it (reaped, or every request ended by a
        # failure): Triton may still hand it back, and it must then be released unanswered. -> when
        self.let_go = {}
        # Correlation ids of requests handed back because their client cancelled them (Triton answers them) -> when
        self.cancelled_by_client = {}
        self.gap = self.metrics.iteration_gap()
        self.released_at = None  # when the last execute() that handed requests back returned
        self.stopping = threading.Event()
        # The reaper answers requests Triton dropped; execute() sends too. NOTE: responses sent from two threads at
        # once crashed tritonserver 2.51 (backend/triton/stub/responses.py), so they take turns.
        self.sending = threading.Lock()
        self.relay = SequenceRelay(pb_utils, self.name)
        # What an execute() made, sent once Triton holds those requests again or has released them (the module's
        # docstring): in the next execute(), or SEND_AFTER_RELEASE_S after this one returned if none comes sooner.
        self.in_execute = False
        self.unsent = {}  # request id -> outputs an execute() made for it, not sent yet
        self.released = set()  # requests released for good: what they made may be sent at any time
        self.returned = threading.Event()
        threading.Thread(target=self._reaper, args=(self.driver.cancelled_after,), name="reaper", daemon=True).start()
        threading.Thread(target=self._send_when_idle, name="sender", daemon=True).start()
        return engine

    def execute(self, requests):
        with self.sending:
            self.in_execute = True
            try:
                return self._execute(requests)
            finally:
                self.in_execute = False
                if self.released:
                    self.returned.set()

    def _send(self, output):
        if self.in_execute:
            self.unsent.setdefault(output.request_id, []).append(output)
        else:
            self.open.send(output)

    def _send_unsent(self, request_ids):
        """Send what was made for ``request_ids``: requests released for good, or handed back in this execute().
        NOTE: never to one Triton holds: it may have answered it (a client's cancel) and freed what a send uses."""
        for request_id in request_ids:
            for output in self.unsent.pop(request_id, ()):
                self.open.send(output)

    def _send_when_idle(self):
        while self.returned.wait() and not self.stopping.is_set():
            time.sleep(SEND_AFTER_RELEASE_S)
            with self.sending:
                self.returned.clear()
                self._send_unsent(self.released)
                self.released.clear()

    def _execute(self, requests):
        started = time.perf_counter()
        handed = {}  # engine request id -> this iteration's Triton request
        for request in requests:
            if self.relay.ends_client_sequence(request):
                self.relay.forward(request)
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
                continue
            correlation_id = int(pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy().item())
            if correlation_id in self.cancelled_by_client:
                # Triton answers a cancelled request it finds in its queue; if it hands one back instead, it is the
                # model's to answer.
                del self.cancelled_by_client[correlation_id]
                pb_utils.Logger.log_warn(f"{self.name}: Triton handed back a cancelled request ({correlation_id})")
                send_error(pb_utils, request.get_response_sender(), CANCELLED)
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
                continue
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
                if request_id is not None:
                    self.released.add(request_id)
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
            else:
                self.request_ids[correlation_id] = request_id
                handed[request_id] = (correlation_id, request)

        # Triton released the last execute()'s requests before it called this one, and those handed back are
        # bound to their new senders: what it made goes out now, while they are in the model's hands again.
        self._send_unsent([*self.released, *handed])
        self.released.clear()
        # What was made for a request Triton no longer hands back (the driver ended it) is never sent.
        self.unsent = {rid: outputs for rid, outputs in self.unsent.items() if self.driver.is_open(rid)}
        unfinished = self.driver.iterate(handed, cancelled=self._cancelled, expired=self.shutdown.expired)
        if self.driver.fatal_error is not None and self.failure is None:  # every open request got its final error
            self.fail(self.driver.fatal_error)
        cancelled = self._hand_cancelled_to_triton([rid for rid in handed if rid not in unfinished])
        for request_id, (correlation_id, request) in handed.items():
            if request_id in unfinished:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            elif request_id in cancelled:
                self.request_ids.pop(correlation_id, None)
                self.cancelled_by_client[correlation_id] = time.perf_counter()
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            else:
                self.request_ids.pop(correlation_id, None)
                self.released.add(request_id)
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
        # Requests the driver ended while Triton held them (reaped: Triton let go of them; or a failure) are
        # forgotten, and remembered as let go until Triton's own idle timeout has surely ended their sequences.
        now = time.perf_counter()
        for correlation_id, request_id in list(self.request_ids.items()):
            if not self.driver.is_open(request_id):
                del self.request_ids[correlation_id]
                self.let_go[correlation_id] = now
        self.let_go = {c: t for c, t in self.let_go.items() if now - t < 2 * self.reap_after}
        self.cancelled_by_client = {c: t for c, t in self.cancelled_by_client.items() if now - t < 2 * self.reap_after}
        self.released_at = time.perf_counter() if unfinished else None
        return None

    def _hand_cancelled_to_triton(self, ended):
        """Those of ``ended`` (their final responses not sent yet) whose client cancelled them: what they made is
        dropped, and they are handed back rather than released, for Triton to answer (the module's docstring)."""
        cancelled = set(self.open.cancelled([rid for rid in ended if rid in self.unsent]))
        for request_id in cancelled:
            for output in self.unsent.pop(request_id):
                if output.finished:
                    self.open.forget(output)
        return cancelled

    def _cancelled(self, request_ids):  # before the step, under the driver's lock
        self.count_joined()
        # A stopped request (the stop board) is not cancelled in Triton: it ends in this step and is released with
        # its final response, as a finished one is.
        stopped = self.open.stopped(request_ids)
        return stopped + [rid for rid in self.open.cancelled(request_ids) if rid not in stopped]

    def _reaper(self, period):
        while not self.stopping.wait(period):
            with self.sending:
                self.driver.reap()

    def finalize(self):
        self.stopping.set()
        self.returned.set()
        with self.sending:
            self._send_unsent(self.released)
        self.relay.join(timeout=5.0)
        super().finalize()
