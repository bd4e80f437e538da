"""One request on its own gRPC stream, read as its responses arrive: the one reader that ``LLMClient``, the Locust
user, the soak and the tests share.

    stream = start_stream("127.0.0.1:8001", "llm_continuous", "Tell me a story", max_tokens=32, stream=True)
    stream.wait(60)
    print(stream.text, stream.finish_reason, stream.error)
    stream.close()

tritonclient calls back on its own thread (a greenlet under Locust) for every response; the stream keeps each one that
carries outputs as a :class:`client.schema.Chunk` (``time_s`` since the request was sent) and is final at the response
flagged ``triton_final_response`` or at an error (our models end a request with its error).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from typing import Any, Iterator

import tritonclient.grpc as grpcclient

from client.schema import Chunk, input_tensors, parse_chunk, raw_input_values


class GrpcStream:
    """A request in flight on a gRPC stream (its own, or a :class:`StreamSession`'s): ``chunks`` as they arrived, and
    how it ended.

    ``final``: the final response or an error arrived (``final_at``, ``perf_counter``). ``exception``: the error, the
    server's or the client library's; ``error`` is its text. After either, or :meth:`cancel`, nothing more is
    recorded.
    """

    def __init__(self, model: str, client: grpcclient.InferenceServerClient | None, owns_client: bool) -> None:
        self.model = model
        self.client = client
        self._owns_client = owns_client
        self.chunks: list[Chunk] = []
        self.exception: Exception | None = None
        self.final = False
        self.cancelled = False
        self.request_id = ""
        self.sent_at = 0.0
        self.final_at: float | None = None
        self._changed = threading.Condition()

    @classmethod
    def start(
        cls,
        client: str | grpcclient.InferenceServerClient,
        model: str,
        inputs: list[grpcclient.InferInput],
        *,
        parameters: dict | None = None,
        request_id: str = "",
        priority: int | None = None,
    ) -> "GrpcStream":
        """Open a stream on ``client`` (a URL: a client of its own, closed with the stream) and send one request,
        with ``priority`` as its Triton priority (``GenerationRequest.priority``; None: the default level).

        A tritonclient client holds at most one stream at a time. If the client library refuses the request, the
        stream is closed and the exception raised.
        """
        owns = isinstance(client, str)
        stream = cls(model, grpcclient.InferenceServerClient(client) if owns else client, owns)
        stream.client.start_stream(callback=stream._on_response)
        stream.request_id = request_id
        stream.sent_at = time.perf_counter()
        try:
            stream.client.async_stream_infer(
                model, inputs, parameters=parameters, request_id=request_id, priority=priority or 0,
                enable_empty_final_response=True,
            )
        except Exception:
            stream.close(cancel=True)
            raise
        return stream

    # -- what arrived

    def _on_response(self, result, error) -> None:
        arrived = time.perf_counter()
        with self._changed:
            # NOTE: after the end nothing counts: e.g. "Locally cancelled by application!" when the stream is closed
            # with cancel_requests=True, after the cancel or after the final response.
            if self.ended:
                return
            if error is not None:
                self._end(arrived, error)
                return
            if result.as_numpy("text_output") is not None:
                self.chunks.append(parse_chunk(result.as_numpy, arrived - self.sent_at))
            if result.get_response().parameters["triton_final_response"].bool_param:
                self._end(arrived)
            self._changed.notify_all()

    def _end(self, at: float, exception: Exception | None = None) -> None:
        # NOTE: called with self._changed held.
        self.final, self.final_at, self.exception = True, at, exception
        self._changed.notify_all()

    @property
    def ended(self) -> bool:
        return self.final or self.cancelled

    @property
    def error(self) -> str | None:
        return None if self.exception is None else str(self.exception)

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.output_ids]

    @property
    def finish_reason(self) -> str:
        """The last response's finish reason ("" while none)."""
        return (self.chunks[-1].finish_reason or "") if self.chunks else ""

    @property
    def arrival_times(self) -> list[float]:
        """``perf_counter`` time at which each chunk arrived."""
        return [self.sent_at + c.time_s for c in self.chunks]

    # -- waiting

    def follow(self, timeout: float, *, from_start: bool = False) -> Iterator[Chunk]:
        """Each chunk as it arrives, until the stream ends (then look at ``exception``). Raises ``TimeoutError`` when
        ``timeout`` s pass without a response, or with ``from_start`` once ``timeout`` s have passed since sending."""
        index = 0
        while True:
            with self._changed:
                deadline = (self.sent_at if from_start else time.perf_counter()) + timeout
                while index == len(self.chunks) and not self.ended:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        raise TimeoutError(f"no response from '{self.model}' within {timeout:g} s")
                    self._changed.wait(left)
                new, ended = self.chunks[index:], self.ended
            for chunk in new:
                yield chunk
            index += len(new)
            if ended and index == len(self.chunks):
                return

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the end; true if the stream ended."""
        with self._changed:
            return self._changed.wait_for(lambda: self.ended, timeout)

    def wait_tokens(self, count: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s for ``count`` responses with outputs; true if they came."""
        with self._changed:
            self._changed.wait_for(lambda: len(self.chunks) >= count or self.ended, timeout)
            return len(self.chunks) >= count

    # -- ending

    def cancel(self) -> None:
        """Cancel the request on the server (Triton's request cancellation) and close the stream."""
        with self._changed:
            if self.client is None or self.ended:
                return
            self.cancelled = True
            self._changed.notify_all()
        self.client.stop_stream(cancel_requests=True)

    def close(self, cancel: bool = False) -> None:
        """End the stream (``cancel``: cancel the request too; otherwise wait for it to finish), then close the client
        if the stream opened it."""
        client, self.client = self.client, None
        if client is None:
            return
        try:
            client.stop_stream(cancel_requests=cancel)
        finally:
            if self._owns_client:
                client.close()


class StreamSession:
    """One gRPC stream kept open for many requests sent in turn, as perf_analyzer and a long-lived client use a
    stream: each request is read by its own :class:`GrpcStream`, sent once the one before it has ended.

    NOTE: one request in flight at a time: Triton's error responses on a stream carry no request id, so an error can
    only be told apart from another request's by being the only one open.
    """

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.current: GrpcStream | None = None
        self._request_ids = itertools.count(1)
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result, error) -> None:
        current = self.current
        if current is None:
            return
        if result is not None and result.get_response().id != current.request_id:
            return  # a late response of an earlier request, one that was given up on
        current._on_response(result, error)

    @property
    def idle(self) -> bool:
        """No request is open on the stream."""
        return self.current is None or self.current.ended

    def send(self, model: str, inputs: list[grpcclient.InferInput], *, parameters: dict | None = None,
             **sequence: Any) -> GrpcStream:
        """Send one request (``sequence``: tritonclient's ``sequence_id``, ``sequence_start``, ``sequence_end``).
        Raises RuntimeError while the request before it is open."""
        if not self.idle:
            raise RuntimeError("the request before this one on the stream is still open")
        stream = GrpcStream(model, None, owns_client=False)
        stream.request_id = str(next(self._request_ids))
        self.current = stream
        stream.sent_at = time.perf_counter()
        self.client.async_stream_infer(model, inputs, parameters=parameters, request_id=stream.request_id,
                                       enable_empty_final_response=True, **sequence)
        return stream

    def close(self, cancel: bool = False) -> None:
        """End the stream (``cancel``: cancel the open request too; otherwise wait for it to finish) and the client."""
        try:
            self.client.stop_stream(cancel_requests=cancel)
        finally:
            self.client.close()


# ---- one request from a prompt and raw values (the soak and the tests: bad requests too) ------------------------


@functools.lru_cache(maxsize=64)
def max_batch_size(url: str, model: str) -> int:
    """The model's ``max_batch_size`` from its config, asked once per URL and model."""
    client = grpcclient.InferenceServerClient(url)
    try:
        return int(client.get_model_config(model, as_json=True)["config"].get("max_batch_size", 0))
    finally:
        client.close()


def start_stream(
    url: str,
    model: str,
    prompt: str | bytes | None = None,
    *,
    inputs: list | None = None,
    parameters: dict | None = None,
    **values: Any,
) -> GrpcStream:
    """Send one request on a new gRPC stream: ``prompt`` and ``values`` as given, unchecked (``inputs`` replaces the
    tensors built from them; a ``priority`` value is sent as the request's Triton priority too). A request the client
    library refuses comes back as a final stream with its error."""
    try:
        if inputs is None:
            inputs = input_tensors(raw_input_values(prompt, **values), max_batch_size(url, model))
        return GrpcStream.start(url, model, inputs, parameters=parameters, priority=values.get("priority"))
    except Exception as exc:  # refused by the client library before anything was sent
        stream = GrpcStream(model, None, owns_client=False)
        stream.final, stream.exception = True, RuntimeError(f"client: {exc}")
        stream.sent_at = stream.final_at = time.perf_counter()
        return stream


def generate(url: str, model: str, prompt: str | bytes | None = None, timeout: float = 120, **kwargs) -> GrpcStream:
    """:func:`start_stream`, then wait up to ``timeout`` s for the end and close the stream."""
    stream = start_stream(url, model, prompt, **kwargs)
    try:
        stream.wait(timeout)
    finally:
        stream.close()
    return stream
