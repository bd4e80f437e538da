"""llm_iterative: Triton's iterative sequence batcher decides the batch at every iteration.

Each execute() gets the requests Triton batched now, new ones (START=1: admitted to the engine) and rescheduled ones
(found by the correlation id Triton gave them); the driver (``IterationDriver``, backend/engine/batching.py) runs one
engine step over exactly those, and the unfinished ones are handed back with RELEASE_RESCHEDULE, their KV blocks kept
in the paged cache. What Triton 2.51 lets the model do with its requests (what is sent when, what is handed back or
released, and why: triton_workarounds.NO_SEND_WHILE_TRITON_HOLDS) is decided by ``IterationBook``
(backend/triton/stub/iteration_book.py); this adapter reads the requests for it, carries out its decisions, and owns the
lock and the threads: the sender (what released requests made, when the book says, if no execute() comes sooner) and
the driver's reaper. A request whose client cancelled it while Triton held it may leave its sequence slot taken in
Triton; once the driver has ended it, the model closes that sequence with a request of its own (``SequenceRelay``).
What every model shares (parsing, the one place that sends, metrics, refusals, the shutdown notice) is
``ServedModel``.
"""

import threading
import time

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import triton_python_backend_utils as pb_utils  # noqa: E402

from backend.engine.batching import IterationDriver  # noqa: E402
from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.triton.stub.iteration_book import CANCELLED_AFTER_S, IterationBook, SequenceRequest  # noqa: E402
from backend.triton.stub.model_config import sequence_idle_seconds  # noqa: E402
from backend.triton.stub.responses import send_error  # noqa: E402
from backend.triton.stub.sequence_relay import CANCELLED, SequenceRelay, flag  # noqa: E402
from backend.triton.stub.served_model import ServedModel  # noqa: E402


class TritonPythonModel(ServedModel, batching="iterative"):
    def start_engine(self, config):
        engine = LLMEngine(config)  # loaded on the thread that steps it: one OpenMP thread team
        self.closed = []  # senders of the model's own closing requests, answered once released (_answer_closed)
        self.cancelled_while_held: list[str] = []  # reaped by the driver as cancelled (IterationBook.close_sequences)
        self.driver = IterationDriver(engine, self._send, self._forget, sequence_idle_seconds(self.model_config),
                                      after_step=self.observe_steps, client_cancelled=self.open.cancelled,
                                      cancelled_after=CANCELLED_AFTER_S)
        self.book = IterationBook(self.driver.reap_after, self.driver.is_open)
        self.gap, self.relay = self.metrics.iteration_gap(), SequenceRelay(pb_utils, self.name)
        self.stopping, self.returned = threading.Event(), threading.Event()  # returned: requests released for good
        # NOTE: responses sent from two threads at once crashed tritonserver 2.51 (triton_workarounds.SINGLE_SENDER):
        # execute(), the sender and the reaper (which answers requests Triton dropped) take turns, as does the book.
        self.sending = threading.Lock()
        threading.Thread(target=self._reaper, args=(self.driver.cancelled_after,), name="reaper", daemon=True).start()
        threading.Thread(target=self._send_when_idle, name="sender", daemon=True).start()
        return engine

    def execute(self, requests):
        with self.sending:
            try:
                self._execute(requests)
            finally:
                if self.book.returned() or self.closed:
                    self.returned.set()

    def _execute(self, requests):
        started = time.perf_counter()
        self._answer_closed()
        plan = self.book.hand_in([self._read(request) for request in requests], started,
                                 admit=lambda item: self.admit(item.request, started, self.driver.add),
                                 resume=lambda rid, item: self.open.rebind(rid, item.request.get_response_sender()))
        for item in plan.relayed:
            self.relay.forward(item.request)
        # Answered once released for good, as every request the book releases (its docstring: what is sent when).
        self.closed += [item.request.get_response_sender() for item in plan.closed]
        for item, error in plan.answered:
            if error == CANCELLED:
                pb_utils.Logger.log_warn(f"{self.name}: Triton handed back a cancelled request ({item.correlation_id})")
            send_error(pb_utils, item.request.get_response_sender(), error)
        for item in plan.released:
            item.request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
        if plan.gap is not None:
            self.gap.observe(plan.gap)
        self._send_all(plan.send)
        self.count_joined()  # before the step (under self.sending: the reaper thread does not touch the engine now)
        unfinished = self.driver.iterate(plan.handed, cancelled=self._cancelled, expired=self.shutdown.expired)
        self._close_sequences()
        if self.driver.fatal_error is not None and self.failure is None:  # every open request got its final error
            self.fail(self.driver.fatal_error)
        done = self.book.hand_back(unfinished, self.open.cancelled, time.perf_counter())
        for output in done.forgotten:
            self.open.forget(output)
        for item in done.rescheduled:
            item.request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        for item in done.released:
            item.request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
        self._send_all(done.send)

    def _read(self, request):
        correlation_id = int(pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy().item())
        start = flag(pb_utils, request, "START")
        return SequenceRequest(correlation_id, start=start, request=request,
                               ends_client_sequence=self.relay.ends_client_sequence(request),
                               closes=start and self.relay.closes_sequence(request))

    def _send(self, output):  # the driver's sink: held during an execute() (the book's docstring)
        if not self.book.hold(output):
            self.open.send(output)

    def _send_all(self, outputs):
        for output in outputs:
            self.open.send(output)

    def _send_when_idle(self):
        while self.returned.wait() and not self.stopping.is_set():
            with self.sending:
                wait = self.book.send_wait(time.perf_counter())  # an execute() coming meanwhile sends them itself
                if not wait:
                    self.returned.clear()
                    self._send_all(self.book.take_released())
                    self._answer_closed()
            time.sleep(wait)

    def _cancelled(self, request_ids):  # after the step, under the driver's lock (IterationDriver.iterate says why)
        # A stopped request (the stop board) is not cancelled in Triton: it ends with this step and is released with
        # its final response, as a finished one is.
        stopped = self.open.stopped(request_ids)
        return stopped + [rid for rid in self.open.cancelled(request_ids) if rid not in stopped]

    def _answer_closed(self):  # under self.sending: the closing requests released for good get their answer
        closed, self.closed = self.closed, []
        for sender in closed:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _forget(self, output):  # the driver's gone sink: Triton answered the request, its client having cancelled it
        self.open.forget(output)
        self.cancelled_while_held.append(output.request_id)

    def _close_sequences(self):  # under self.sending, after the driver reaped
        reaped, self.cancelled_while_held = self.cancelled_while_held, []
        for correlation_id in self.book.close_sequences(reaped, time.perf_counter()) if reaped else ():
            self.relay.close_sequence(correlation_id)

    def _reaper(self, period):
        while not self.stopping.wait(period):
            with self.sending:
                self.driver.reap()
                self._close_sequences()

    def finalize(self):
        self.stopping.set()
        self.returned.set()
        with self.sending:
            self._send_all(self.book.take_released())
            self._answer_closed()
        self.relay.join(timeout=5.0)
        super().finalize()
