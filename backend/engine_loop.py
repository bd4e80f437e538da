"""The engine on its own thread: a thread-safe streaming front for the server (continuous batching).

Other threads ``submit`` and ``abort``; only the loop thread touches the engine. The loop sleeps on a condition
variable when there is nothing to do (no busy spinning) and wakes on submit. Every output, errors included, leaves
through one sink, so a server adapter sends responses from exactly one place.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator

from backend.config import SamplingParams
from backend.engine import LLMEngine, RequestOutput
from backend.request import FinishReason

log = logging.getLogger(__name__)

OutputSink = Callable[[RequestOutput], None]


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
    ) -> None:
        """``sink`` receives every output (default: per-request :class:`RequestStream` objects).
        ``before_step`` runs on the loop thread before each step and returns the ids of requests to abort
        (the server checks its clients' cancellations there, so an abort takes effect within one step)."""
        self.engine = engine
        self._sink = sink or self._to_stream
        self._before_step = before_step
        self._streams: dict[str, RequestStream] = {}
        self._inbox: list[tuple[str, str | list[int], SamplingParams, float | None]] = []
        self._aborts: list[str] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.fatal_error: BaseException | None = None

    # ---- called from any thread -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    def submit(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float | None = None
    ) -> RequestStream:
        stream = RequestStream(request_id)
        with self._cv:
            if self._stopping or not self.is_alive:
                raise RuntimeError("the engine is shutting down" if self._stopping else "the engine is not running")
            self._streams[request_id] = stream
            self._inbox.append((request_id, prompt, params, arrival_time))
            self._cv.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; every request still open gets a final error response."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

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
                for request_id, prompt, params, arrival in inbox:
                    try:
                        engine.add_request(request_id, prompt, params, arrival)
                    except ValueError as exc:  # a bad request fails alone
                        self._emit(RequestOutput(request_id, "", [], finished=True, finish_reason="error", error=str(exc)))
                if self._before_step is not None:
                    aborts += self._before_step() or ()
                for request_id in aborts:
                    output = engine.abort(request_id)
                    if output is not None:
                        self._emit(output)
                if engine.has_unfinished():
                    for output in engine.step():
                        self._emit(output)
        except BaseException as exc:  # the engine cannot go on: nobody may wait forever
            log.exception("engine loop failed")
            self.fatal_error = exc
        self._fail_all("the server is shutting down" if self.fatal_error is None else f"engine failed: {self.fatal_error}")

    def _fail_all(self, message: str) -> None:
        with self._cv:
            self._stopping = True
            pending = [rid for rid, *_ in self._inbox]
            self._inbox = []
        for request_id in pending + self.engine.unfinished_request_ids():
            self.engine.abort(request_id, FinishReason.ABORT)
            self._emit(RequestOutput(request_id, "", [], finished=True, finish_reason="abort", error=message))

    def _emit(self, output: RequestOutput) -> None:
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
