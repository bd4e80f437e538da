"""The ways of driving a batch through the engine, side by side. Who decides the batch is this project's subject.

* :func:`run_to_completion` (``llm_dynamic``, ``llm_static``): Triton's batcher has formed the batch; step the
  engine on the caller's thread until every member has its final output. Nothing joins a running batch.
* :class:`EngineLoop` (``llm_continuous``): the engine on a thread of its own decides the batch; requests join and
  leave at every step.
* :class:`IterationDriver` (``llm_iterative``): Triton's iterative sequence batcher decides the batch at every
  iteration; each ``execute()`` runs one engine step over exactly the requests Triton handed it.

They live in ``backend/engine``, free of Triton, because what differs between them is engine logic (when to step,
when requests may join, how open requests end), and their tests need no server. The server's part comes in as
callables: a ``sink`` that receives every output, a cancellation check, the shutdown deadline, a metrics hook;
``backend/triton/stub`` and the ``model.py`` files supply them. All follow one rule: every request handed over gets
exactly one final output, whatever happens: it finishes, it is aborted, the engine refuses it
(``FinishReason.REFUSED``), a step fails (``ERROR``), the server shuts down (``ABORT`` with :data:`SHUTTING_DOWN`),
or the engine breaks (``ERROR`` with :func:`engine_failed`); :func:`end_all` is the one way to end open requests.
Every error message is built by the contract (``backend/contract/errors.py``), its kind in front.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import Future

from backend.contract import errors
from backend.contract.errors import ErrorKind
from backend.engine.llm_engine import LLMEngine, RequestOutput
from backend.engine.request import FinishReason
from backend.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

OutputSink = Callable[[RequestOutput], None]

SHUTTING_DOWN = errors.message(ErrorKind.SHUTTING_DOWN, "the server is shutting down")
# A request Triton's iterative sequence batcher let go of while its client still waited (IterationDriver).
DROPPED = errors.message(ErrorKind.DROPPED, "the server lost track of this request (Triton's sequence batcher did not "
                         "hand it back to the model) and ended it; this was not caused by the client: send it again")


def engine_failed(exc: BaseException) -> str:
    """The error every request gets once the engine broke in a way no step can contain."""
    return errors.message(ErrorKind.ENGINE_FAILED, f"the engine failed and cannot go on ({exc!r}); restart the server")


def end_all(
    engine: LLMEngine, request_ids: Iterable[str], message: str, reason: FinishReason, sink: OutputSink
) -> None:
    """Give each request its final output now, ``message`` as its error; the engine frees what it held."""
    for request_id in request_ids:
        try:
            engine.abort(request_id, reason)
        except Exception:  # after a fatal error the engine's state may be broken; the error still goes out
            log.exception("aborting %s failed", request_id)
        deliver(sink, RequestOutput(request_id, "", [], finished=True, finish_reason=reason.value, error=message))


def deliver(sink: OutputSink, output: RequestOutput) -> None:
    try:
        sink(output)
    except Exception:  # a broken client connection must not stop the batch or the loop
        log.exception("sending output for %s failed", output.request_id)


# ---- run a batch to completion (llm_dynamic, llm_static) ----------------------------------------------------


def run_to_completion(
    engine: LLMEngine,
    request_ids: Iterable[str],
    sink: OutputSink,
    cancelled: Callable[[Collection[str]], Iterable[str]] = lambda ids: (),
    expired: Callable[[], bool] = lambda: False,
    after_step: Callable[[], None] = lambda: None,
) -> BaseException | None:
    """Step the engine on this thread until every request of the batch (already added) has its final output.

    Before each step, ``cancelled(open_ids)`` names the requests whose client went away (they are aborted) and
    ``expired()`` says whether the shutdown deadline passed (every open request then ends with
    :data:`SHUTTING_DOWN`). Returns the exception that broke the engine, after every open request got
    :func:`engine_failed` as its error; the caller then refuses whatever comes next.
    """
    open_ids = set(request_ids)

    def emit(output: RequestOutput) -> None:
        if output.finished:
            open_ids.discard(output.request_id)
        deliver(sink, output)

    try:
        while engine.has_unfinished():  # until the longest member of the batch is done
            if expired():
                end_all(engine, sorted(open_ids), SHUTTING_DOWN, FinishReason.ABORT, emit)
                return None
            outputs = [engine.abort(request_id) for request_id in list(cancelled(open_ids))]
            for output in filter(None, outputs + engine.step()):
                emit(output)
            after_step()
    except BaseException as exc:  # the engine cannot go on: nobody may wait forever
        log.exception("engine failed")
        end_all(engine, sorted(open_ids), engine_failed(exc), FinishReason.ERROR, emit)
        return exc
    return None


# ---- the engine's own loop thread (llm_continuous) ----------------------------------------------------------


class EngineUnavailable(RuntimeError):
    """``submit`` refused a request: the loop is stopping (:data:`SHUTTING_DOWN`), or the engine failed and cannot go
    on (:func:`engine_failed`). The message is the one its client gets."""


class EngineOverloaded(RuntimeError):
    """``submit`` refused a request because ``max_queue_size`` requests are already waiting. The message is the one
    its client gets."""


class RequestStream:
    """The outputs of one request, in order; iteration ends after the final one."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def get(self, timeout: float | None = None) -> RequestOutput:
        return self._queue.get(timeout=timeout)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            output = self._queue.get()
            yield output
            if output.finished:
                return


class EngineLoop:
    """The engine on its own thread (continuous batching): a thread-safe streaming front for the server.

    Other threads ``submit`` and ``abort``; only the loop thread touches the engine. The loop sleeps on a condition
    variable when there is nothing to do (no busy spinning) and wakes on submit. Every output, errors included,
    leaves through one sink. The one exception to "exactly one final output" is ``shutdown(notify=False)``, for a
    server that can no longer deliver anything.
    """

    def __init__(
        self,
        engine: LLMEngine,
        sink: OutputSink | None = None,
        before_step: Callable[[], Iterable[str]] | None = None,
        after_step: Callable[[], None] | None = None,
    ) -> None:
        """``sink`` receives every output (default: per-request :class:`RequestStream` objects).
        ``before_step`` runs on the loop thread before each step and returns the ids of requests to abort
        (the server checks its clients' cancellations there, so an abort takes effect within one step).
        ``after_step`` runs on the loop thread after each step and before the loop goes idle (metrics)."""
        self.engine = engine
        self.max_queue_size = engine.config.max_queue_size
        self._sink = sink or self._to_stream
        self._keeps_streams = sink is None
        self._before_step = before_step
        self._after_step = after_step
        self._streams: dict[str, RequestStream] = {}
        self._inbox: list[tuple[str, str | list[int], SamplingParams, float | None, int]] = []
        self._aborts: list[str] = []
        self._open: set[str] = set()  # submitted and not yet given their final output
        self._cv = threading.Condition()
        self._stopping = False
        self._draining = False
        self._notify_on_stop = True
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.fatal_error: BaseException | None = None

    @classmethod
    def build(
        cls,
        make_engine: Callable[[], LLMEngine],
        sink: OutputSink | None = None,
        before_step: Callable[[], Iterable[str]] | None = None,
        after_step: Callable[[], None] | None = None,
    ) -> EngineLoop:
        """Build the engine on a new thread and run the loop on that same thread; returns once the engine is
        built (its exception, if building fails). The loop is already running: :meth:`start` does nothing.

        NOTE: libgomp gives every thread that starts an OpenMP region its own thread team. An engine loaded on one
        thread and stepped on another leaves two teams in the process, more OpenMP threads than cores on a small
        machine, and libgomp then cuts its spin-waits short (``gomp_throttled_spin_count_var``): every one of a
        step's hundreds of parallel regions wakes a sleeping thread. Loading and stepping on one thread keeps one
        team, whose threads spin briefly between regions (``backend/engine/openmp.py``).
        """
        built: Future[EngineLoop] = Future()

        def main() -> None:
            try:
                loop = cls(make_engine(), sink, before_step, after_step)
            except BaseException as exc:
                built.set_exception(exc)
                return
            loop._thread = threading.current_thread()
            built.set_result(loop)
            loop._run()

        threading.Thread(target=main, name="engine-loop", daemon=True).start()
        return built.result()

    # ---- called from any thread -----------------------------------------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive():  # a loop from build() runs already
            self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    def submit(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request for the loop. Raises :class:`EngineOverloaded` when ``max_queue_size`` requests are
        already waiting, :class:`EngineUnavailable` when the loop is stopping or has failed."""
        stream = RequestStream(request_id)
        with self._cv:
            if self.fatal_error is not None:
                raise EngineUnavailable(engine_failed(self.fatal_error))
            if self._stopping or self._draining or not self._thread.is_alive():
                raise EngineUnavailable(SHUTTING_DOWN)
            # NOTE: the inbox moves into the scheduler under this lock, so every request is counted in one of the
            # two; len() of the scheduler's deque is atomic, and the loop thread only pops from it.
            num_waiting = len(self._inbox) + self.engine.scheduler.num_waiting
            if num_waiting >= self.max_queue_size:
                raise EngineOverloaded(errors.message(
                    ErrorKind.OVERLOADED, f"the server is overloaded: {num_waiting} requests are already waiting "
                    f"(max_queue_size={self.max_queue_size}); retry later"))
            if self._keeps_streams:
                self._streams[request_id] = stream
            self._open.add(request_id)
            self._inbox.append((request_id, prompt, params, arrival_time, priority))
            self._cv.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def drain(self, seconds: float) -> None:
        """Refuse new requests from now on; those already submitted run for up to ``seconds``, then
        :meth:`shutdown` ends whatever is left with a final error."""
        with self._cv:
            self._draining = True
        timer = threading.Timer(seconds, self.shutdown, kwargs={"timeout": 0})
        timer.daemon = True
        timer.start()

    def shutdown(self, timeout: float = 30.0, notify: bool = True) -> bool:
        """Stop the loop and join it; returns whether it stopped. With ``notify`` every request still open gets a
        final error through the sink; without, the loop stops without calling the sink or the hooks again (for a
        server that can no longer deliver responses, e.g. Triton's Python backend during finalize)."""
        with self._cv:
            self._stopping = True
            self._notify_on_stop = notify
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the loop thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    while not (self._inbox or self._aborts or self._stopping or engine.has_unfinished()):
                        self._cv.wait()
                    if self._stopping:
                        break
                    refused = [self._add(*request) for request in self._inbox]
                    self._inbox = []
                    aborts, self._aborts = self._aborts, []
                for output in filter(None, refused):
                    self._emit(output)
                aborts += self._call(self._before_step) or ()
                for output in filter(None, map(engine.abort, aborts)):
                    self._emit(output)
                if engine.has_unfinished():
                    for output in engine.step():
                        self._emit(output)
                self._call(self._after_step)
        except BaseException as exc:  # the engine cannot go on: nobody may wait forever
            log.exception("engine loop failed")
            with self._cv:
                self.fatal_error = exc
        if self.fatal_error is None and not self._notify_on_stop:
            return
        if self.fatal_error is None:
            self._fail_all(SHUTTING_DOWN, FinishReason.ABORT)
        else:
            self._fail_all(engine_failed(self.fatal_error), FinishReason.ERROR)

    def _add(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival: float | None,
             priority: int):
        """Hand one submitted request to the engine; a request it cannot take fails alone (its final output)."""
        try:
            self.engine.add_request(request_id, prompt, params, arrival, priority)
        except ValueError as exc:
            return RequestOutput(request_id, "", [], finished=True, finish_reason=FinishReason.REFUSED.value,
                                 error=errors.refusal(exc))
        return None

    def _fail_all(self, message: str, reason: FinishReason) -> None:
        """Give every request still open its final output: ``message`` as an error."""
        with self._cv:
            self._stopping = True
            self._inbox = []
            pending = sorted(self._open)
        end_all(self.engine, pending, message, reason, self._emit)
        self._call(self._after_step)

    @staticmethod
    def _call(hook: Callable | None):
        """Run a server hook; its failure (a metrics or IPC hiccup) is logged and never stops the engine."""
        if hook is None:
            return None
        try:
            return hook()
        except Exception:
            log.exception("engine loop hook %s failed", getattr(hook, "__name__", hook))
            return None

    def _emit(self, output: RequestOutput) -> None:
        if output.finished:
            with self._cv:
                self._open.discard(output.request_id)
        deliver(self._sink, output)

    def _to_stream(self, output: RequestOutput) -> None:
        with self._cv:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
        if stream is not None:
            stream.put(output)


# ---- one step per Triton iteration (llm_iterative) ----------------------------------------------------------


class IterationDriver:
    """Triton decides the batch at every iteration (iterative sequence batching): :meth:`iterate` runs one engine
    step over exactly the requests Triton handed back now; the others are not stepped and keep their KV blocks.

    Outputs go to a request only while Triton has handed it in: the shutdown deadline and a broken engine end each
    request when it is next handed in. Triton hands every request it holds back at its next iteration, so one it
    has not handed back for a while was let go of; it is ended and its blocks freed:
    - its client cancelled it while it waited to be rescheduled (``client_cancelled`` says so), after
      ``cancelled_after`` seconds: Triton answered it itself, nothing more may be sent to it, and its final output
      goes to ``gone`` instead of the sink;
    - otherwise, after ``reap_after`` seconds (Triton's own idle time), Triton dropped it (2.51 refuses to
      reschedule a request whose sequence its reaper ended: triton_workarounds.NO_SEND_WHILE_TRITON_HOLDS): the
      model still holds its response sender, and its client gets the final error :data:`DROPPED` through the sink.
      NOTE: not sooner: until Triton's idle time has passed, a request not handed back may still come back
      (``oldest`` sometimes runs a subset of what it holds).
    One lock: :meth:`iterate` runs on Triton's thread, :meth:`reap` may run on a timer thread; sends never overlap.
    """

    def __init__(self, engine: LLMEngine, sink: OutputSink, gone: OutputSink, reap_after: float = 5.0,
                 after_step: Callable[[], None] = lambda: None,
                 client_cancelled: Callable[[Collection[str]], Iterable[str]] = lambda ids: ids,
                 cancelled_after: float | None = None) -> None:
        self.engine = engine
        self.reap_after = reap_after
        self._cancelled_after = cancelled_after
        self.fatal_error: BaseException | None = None
        self._sink = sink
        self._gone = gone
        self._after_step = after_step
        self._client_cancelled = client_cancelled
        self._last_seen: dict[str, float] = {}  # open request -> time.monotonic() it was last handed in or back
        self._lock = threading.Lock()

    def add(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival: float | None,
            priority: int = 0) -> bool:
        """Hand a new request to the engine; one it cannot take gets its final output (refused) here."""
        with self._lock:
            try:
                self.engine.add_request(request_id, prompt, params, arrival, priority)
            except ValueError as exc:
                deliver(self._sink, RequestOutput(request_id, "", [], finished=True,
                                                  finish_reason=FinishReason.REFUSED.value, error=errors.refusal(exc)))
                return False
            self._last_seen[request_id] = time.monotonic()
            return True

    @property
    def cancelled_after(self) -> float:
        """How long a request its client cancelled may go without being handed back (at most ``reap_after``)."""
        return self.reap_after if self._cancelled_after is None else min(self._cancelled_after, self.reap_after)

    def is_open(self, request_id: str) -> bool:
        return request_id in self._last_seen

    def iterate(
        self,
        request_ids: Collection[str],
        cancelled: Callable[[Collection[str]], Iterable[str]] = lambda ids: (),
        expired: Callable[[], bool] = lambda: False,
    ) -> set[str]:
        """One step over exactly ``request_ids`` (those Triton handed in); returns the ones to reschedule (not
        finished). ``cancelled`` is asked after the step which of them are still open and cancelled (or stopped)
        by their clients: they end now, with their final outputs. After the shutdown deadline they end with
        :data:`SHUTTING_DOWN`; once the engine failed (this step or before; ``fatal_error``), with
        :func:`engine_failed`."""
        with self._lock:
            now = time.monotonic()
            handed = [rid for rid in request_ids if rid in self._last_seen]
            self._last_seen.update(dict.fromkeys(handed, now))
            try:
                if self.fatal_error is not None:
                    raise self.fatal_error
                if expired():
                    end_all(self.engine, handed, SHUTTING_DOWN, FinishReason.ABORT, self._emit)
                    return set()
                self._reap(now)
                for output in filter(None, self.engine.step(only=handed)):
                    self._emit(output)
                # NOTE: asked after the step, not before it: clients cancel in answer to what the model sent as this
                # iteration began, so most cancels land during the step. Ended now, such a request frees its seat
                # and KV blocks for the next batch and is handed back for Triton to answer (the iteration book).
                # Asked before the next step instead, it was handed back alive; Triton answered it itself and never
                # handed it in again, so it kept an engine seat until reaped (cancelled_after), and with every seat
                # taken the requests Triton did hand in were not stepped: cancelling clients left llm_iterative
                # at a quarter of llm_continuous's request rate (make soak).
                still_open = [rid for rid in handed if rid in self._last_seen]
                for output in filter(None, [self.engine.abort(rid) for rid in list(cancelled(still_open))]):
                    self._emit(output)
            except BaseException as exc:  # the engine cannot go on: nobody may wait forever
                if self.fatal_error is None:
                    log.exception("engine failed")
                    self.fatal_error = exc
                end_all(self.engine, [r for r in handed if r in self._last_seen], engine_failed(exc),
                        FinishReason.ERROR, self._emit)
                return set()
            finally:
                self._after_step()
            released = time.monotonic()
            unfinished = {rid for rid in handed if rid in self._last_seen}
            self._last_seen.update(dict.fromkeys(unfinished, released))
            return unfinished

    def reap(self) -> None:
        """End the requests Triton let go of (see the class)."""
        with self._lock:
            if self._reap(time.monotonic()):
                self._after_step()

    def _reap(self, now: float) -> list[str]:
        waiting = sorted(rid for rid, seen in self._last_seen.items() if now - seen > self.cancelled_after)
        if not waiting:
            return []
        cancelled = sorted(self._client_cancelled(waiting))
        dropped = [rid for rid in waiting if rid not in cancelled and now - self._last_seen[rid] > self.reap_after]
        stale = cancelled + dropped
        if stale:
            log.warning("ending %d requests Triton did not hand back: %d cancelled by their clients (%.0f s), %d "
                        "dropped by Triton (%.0f s; answered with an error)", len(stale), len(cancelled),
                        self.cancelled_after, len(dropped), self.reap_after)
            for rid in stale:
                self._last_seen.pop(rid)
            end_all(self.engine, cancelled, errors.message(
                ErrorKind.CANCELLED, f"not handed back by Triton within {self.cancelled_after:.0f} s"),
                FinishReason.ABORT, self._gone)
            end_all(self.engine, dropped, DROPPED, FinishReason.ERROR, self._sink)
        return stale

    def _emit(self, output: RequestOutput) -> None:
        if output.finished:
            self._last_seen.pop(output.request_id, None)
        deliver(self._sink, output)
