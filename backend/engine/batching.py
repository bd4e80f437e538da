"""The engine on its own thread: a thread-safe streaming front for the server (continuous batching).

Other threads ``submit`` and ``abort``; only the loop thread touches the engine. The loop sleeps on a condition
variable when there is nothing to do (no busy spinning) and wakes on submit. Every output, errors included, leaves
through one sink, so a server adapter sends responses from exactly one place.

Every request submitted gets exactly one final output, whatever happens: it finishes, it is aborted, the engine
refuses it (``finish_reason == REFUSED``), a step fails (``"error"``), or the loop stops and every request still
open gets a final output carrying an error (``"abort"`` on shutdown, ``"error"`` when the engine failed). The one
exception is ``shutdown(notify=False)``, for a server that can no longer deliver anything.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future

from backend.engine.config import SamplingParams
from backend.engine.llm_engine import LLMEngine, RequestOutput
from backend.engine.request import FinishReason

log = logging.getLogger(__name__)

OutputSink = Callable[[RequestOutput], None]

# finish_reason of the final output of a request the engine would not take (bad prompt, can never fit).
REFUSED = "refused"
SHUTTING_DOWN = "the server is shutting down"


class EngineUnavailable(RuntimeError):
    """``submit`` refused a request: the loop is stopping, or the engine failed and cannot go on."""


class EngineOverloaded(RuntimeError):
    """``submit`` refused a request because ``max_queue_size`` requests are already waiting."""


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
        self._inbox: list[tuple[str, str | list[int], SamplingParams, float | None]] = []
        self._aborts: list[str] = []
        self._open: set[str] = set()  # submitted and not yet given their final output
        # Requests waiting for a first step: the inbox plus the scheduler's waiting queue, as the loop last saw it.
        self._num_waiting = 0
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
        team, whose threads spin briefly between regions (``backend/__init__.py``).
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
        self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float | None = None
    ) -> RequestStream:
        """Queue a request for the loop. Raises :class:`EngineOverloaded` when ``max_queue_size`` requests are
        already waiting, :class:`EngineUnavailable` when the loop is stopping or has failed."""
        stream = RequestStream(request_id)
        with self._cv:
            if self.fatal_error is not None:
                raise EngineUnavailable(f"the engine failed and cannot serve requests ({self.fatal_error!r}); "
                                        "restart the server")
            if self._stopping or self._draining or not self._thread.is_alive():
                raise EngineUnavailable(SHUTTING_DOWN)
            num_waiting = self._num_waiting + len(self._inbox)
            if num_waiting >= self.max_queue_size:
                raise EngineOverloaded(
                    f"the server is overloaded: {num_waiting} requests are already waiting "
                    f"(max_queue_size={self.max_queue_size}); retry later"
                )
            if self._keeps_streams:
                self._streams[request_id] = stream
            self._open.add(request_id)
            self._inbox.append((request_id, prompt, params, arrival_time))
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
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                    self._num_waiting += len(inbox)  # they wait in the scheduler from now on
                for request_id, prompt, params, arrival in inbox:
                    try:
                        engine.add_request(request_id, prompt, params, arrival)
                    except ValueError as exc:  # a request the engine cannot take fails alone
                        self._emit(RequestOutput(request_id, "", [], finished=True, finish_reason=REFUSED,
                                                 error=str(exc)))
                aborts += self._call(self._before_step) or ()
                for request_id in aborts:
                    output = engine.abort(request_id)
                    if output is not None:
                        self._emit(output)
                if engine.has_unfinished():
                    for output in engine.step():
                        self._emit(output)
                with self._cv:
                    self._num_waiting = engine.scheduler.num_waiting
                self._call(self._after_step)
        except BaseException as exc:  # the engine cannot go on: nobody may wait forever
            log.exception("engine loop failed")
            with self._cv:
                self.fatal_error = exc
        if self.fatal_error is None and not self._notify_on_stop:
            return
        if self.fatal_error is None:
            self._fail_all(SHUTTING_DOWN, "abort")
        else:
            self._fail_all(f"the engine failed and cannot go on ({self.fatal_error!r}); restart the server", "error")

    def _fail_all(self, message: str, finish_reason: str) -> None:
        """Give every request still open its final output: ``message`` as an error."""
        with self._cv:
            self._stopping = True
            self._inbox = []
            pending = sorted(self._open)
        for request_id in pending:
            try:
                self.engine.abort(request_id, FinishReason.ABORT)  # frees its KV blocks
            except Exception:  # after a fatal error the engine's state may be broken; the error still goes out
                log.exception("aborting %s failed", request_id)
            self._emit(RequestOutput(request_id, "", [], finished=True, finish_reason=finish_reason, error=message))
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
        try:
            self._sink(output)
        except Exception:  # a broken client connection must not stop the loop
            log.exception("sending output for %s failed", output.request_id)

    def _to_stream(self, output: RequestOutput) -> None:
        with self._cv:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
        if stream is not None:
            stream.put(output)
