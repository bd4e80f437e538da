"""A small client for the two LLM models served on Triton (``llm_dynamic``, ``llm_continuous``).

One request type, one result type, two protocols:

    client = LLMClient()                                   # gRPC at 127.0.0.1:8001
    generation = client.stream("llm_continuous", GenerationRequest("Tell me a story", max_tokens=32))
    for chunk in generation:                               # Chunk: text delta, token ids, counts
        print(chunk.text, end="", flush=True)
    result = generation.result()                           # GenerationResult: text, ttft_s, tpot_s, e2e_s, ...

gRPC uses Triton's bidirectional stream (one stream per request, final response flagged by
``triton_final_response``); HTTP uses ``/v2/models/<m>/generate_stream`` (SSE) when ``stream`` is true and
``/v2/models/<m>/generate`` otherwise. Timings are measured with ``time.perf_counter`` from the moment the request
is sent. An ``LLMClient`` may be shared by threads: each generation has its own stream or HTTP response.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import asdict
from typing import Any, Callable, Iterator

import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.grpc_stream import GrpcStream
from client.schema import (
    Chunk,
    GenerationRequest,
    GenerationResult,
    ModelInfo,
    build_inputs,
    describe_batching,
    parse_chunk,
)

DEFAULT_GRPC_URL = "127.0.0.1:8001"
DEFAULT_HTTP_URL = "127.0.0.1:8000"


# ---------------------------------------------------------------------------------------------- errors


class ClientError(Exception):
    """Base of this client's errors; the message is meant for a user and fits on one line."""


class ServerUnavailable(ClientError):
    """No Triton server answers at the URL."""


class ModelNotServed(ClientError):
    """The server does not serve (or has not loaded) the model."""


class GenerationError(ClientError):
    """The server answered this request with an error; the message is the server's."""


# ---------------------------------------------------------------------------------------------- a generation


class Generation:
    """A request in flight. Iterate it for :class:`Chunk` s; ``result()`` waits for the end; ``cancel()`` aborts.

    Iterating (and ``result()``) raises :class:`GenerationError` if the server answers with an error.
    ``ended_at`` is the ``perf_counter`` time of the final response: the transport sets it when it sees the final
    flag, so closing the stream afterwards does not count; otherwise it is when iteration ends.
    """

    def __init__(self, chunks: Iterator[Chunk], cancel: Callable[[], None], started: float) -> None:
        self._source = chunks
        self._cancel = cancel
        self._started = started
        self._chunks: list[Chunk] = []
        self._result: GenerationResult | None = None
        self._error: GenerationError | None = None
        self.ended_at: float | None = None
        self.cancelled = False

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> Chunk:
        if self._error is not None:
            raise self._error
        if self._result is not None:
            raise StopIteration
        try:
            chunk = next(self._source)
        except GenerationError as exc:
            self._error = exc
            raise
        except StopIteration:
            e2e_s = (self.ended_at or time.perf_counter()) - self._started
            self._result = GenerationResult.from_chunks(self._chunks, e2e_s, self.cancelled)
            raise
        self._chunks.append(chunk)
        return chunk

    def cancel(self) -> None:
        """Ask the server to stop this request; iteration then ends (``result().cancelled`` is true)."""
        if self._result is not None or self._error is not None:
            return
        self.cancelled = True
        self._cancel()

    def result(self) -> GenerationResult:
        """Consume what is left and return the finished :class:`GenerationResult`."""
        for _ in self:
            pass
        assert self._result is not None
        return self._result


# ---------------------------------------------------------------------------------------------- the client


class LLMClient:
    """Talks to one Triton server over gRPC (default) or HTTP; caches each model's config.

    ``timeout``: seconds to wait for any one response before the request is cancelled and fails.
    """

    def __init__(
        self,
        url: str = DEFAULT_GRPC_URL,
        http_url: str = DEFAULT_HTTP_URL,
        protocol: str = "grpc",
        timeout: float = 600.0,
    ) -> None:
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be 'grpc' or 'http', not {protocol!r}")
        self.url = url
        self.http_url = http_url if "://" in http_url else f"http://{http_url}"
        self.protocol = protocol
        self.timeout = timeout
        self._grpc: grpcclient.InferenceServerClient | None = None
        self._session = requests.Session()
        self._configs: dict[str, dict] = {}
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        """The server address this client's protocol uses, as a user would type it."""
        return self.url if self.protocol == "grpc" else self.http_url.split("://", 1)[1]

    def close(self) -> None:
        if self._grpc is not None:
            self._grpc.close()
        self._session.close()

    def __enter__(self) -> "LLMClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- server and models

    def _server_down(self) -> ServerUnavailable:
        return ServerUnavailable(f"no Triton server at {self.address} — start one with `make serve`")

    def _grpc_call(self, method: str, *args, **kwargs) -> Any:
        with self._lock:
            if self._grpc is None:
                self._grpc = grpcclient.InferenceServerClient(self.url)
        try:
            return getattr(self._grpc, method)(*args, client_timeout=30.0, **kwargs)
        except InferenceServerException as exc:
            if exc.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED"):
                raise self._server_down() from None
            raise

    def _http_call(self, method: str, path: str) -> requests.Response:
        try:
            return self._session.request(method, f"{self.http_url}{path}", timeout=30.0)
        except requests.ConnectionError:
            raise self._server_down() from None

    def models(self) -> list[ModelInfo]:
        """Every model in the server's repository index, with its state and (when ready) batching mode."""
        if self.protocol == "grpc":
            index = self._grpc_call("get_model_repository_index", as_json=True).get("models", [])
        else:
            index = self._http_call("POST", "/v2/repository/index").json()
        infos = []
        for entry in index:
            info = ModelInfo(entry["name"], entry.get("version", ""), entry.get("state", ""), entry.get("reason", ""))
            if info.is_ready:
                info = ModelInfo(**{**asdict(info), "batching": describe_batching(self.model_config(info.name))})
            infos.append(info)
        return infos

    def _not_served(self, model: str) -> ModelNotServed:
        infos = self.models()
        for info in infos:
            if info.name == model:
                why = f": {info.reason}" if info.reason else ""
                return ModelNotServed(f"model '{model}' is not ready (state {info.state or 'unknown'}{why})")
        served = ", ".join(i.name for i in infos if i.is_ready) or "(none)"
        return ModelNotServed(f"model '{model}' is not served; served models: {served}")

    def model_config(self, model: str) -> dict:
        """The model's config (fetched once per client, then cached); raises ModelNotServed if unknown."""
        with self._lock:
            if model in self._configs:
                return self._configs[model]
        if self.protocol == "grpc":
            try:
                config = self._grpc_call("get_model_config", model, as_json=True)["config"]
            except InferenceServerException:
                raise self._not_served(model) from None
        else:
            response = self._http_call("GET", f"/v2/models/{model}/config")
            if response.status_code != 200:
                raise self._not_served(model)
            config = response.json()
        with self._lock:
            self._configs[model] = config
        return config

    # -- generation

    def stream(self, model: str, request: GenerationRequest) -> Generation:
        """Send ``request`` to ``model`` and return the :class:`Generation` in flight."""
        config = self.model_config(model)
        if self.protocol == "grpc":
            return self._grpc_stream(model, build_inputs(request, int(config.get("max_batch_size", 0))),
                                     request.priority)
        return self._http_stream(model, request)

    def generate(self, model: str, request: GenerationRequest) -> GenerationResult:
        """Send ``request`` and wait for the whole :class:`GenerationResult`."""
        return self.stream(model, request).result()

    def _grpc_stream(self, model: str, inputs: list[grpcclient.InferInput], priority: int | None) -> Generation:
        # NOTE: a tritonclient InferenceServerClient holds at most one stream, so each generation gets its own.
        stream = GrpcStream.start(self.url, model, inputs, request_id=uuid.uuid4().hex, priority=priority)

        def chunks() -> Iterator[Chunk]:
            try:
                for chunk in stream.follow(self.timeout):
                    if chunk.num_tokens or chunk.finish_reason:
                        yield chunk
            except TimeoutError as exc:
                raise GenerationError(str(exc)) from None
            finally:
                # Cancels the request unless its final response came (timeout, abandoned iteration). NOTE: an error
                # ends the request (the models send it as the final response; Triton's own refusals come before the
                # request starts), so nothing is left to cancel.
                stream.close(cancel=not stream.final)
            if stream.final:
                generation.ended_at = stream.final_at
            if stream.exception is not None and not generation.cancelled:
                raise GenerationError(f"'{model}': {stream.exception.message()}")

        generation = Generation(chunks(), stream.cancel, stream.sent_at)
        return generation

    def _http_stream(self, model: str, request: GenerationRequest) -> Generation:
        endpoint = "generate_stream" if request.stream else "generate"
        payload = {k: (v if k == "stop" else v[0]) for k, v in request.input_values().items()}
        started = time.perf_counter()
        try:
            response = self._session.post(
                f"{self.http_url}/v2/models/{model}/{endpoint}", json=payload, stream=True, timeout=(30.0, self.timeout)
            )
        except requests.ConnectionError:
            raise self._server_down() from None
        except requests.RequestException as exc:
            raise GenerationError(f"'{model}': {exc}") from None

        def answer(body: dict) -> dict:
            if response.status_code >= 400 or "error" in body:
                raise GenerationError(f"'{model}': {body.get('error') or f'HTTP {response.status_code}'}")
            return body

        def chunks() -> Iterator[Chunk]:
            with response:
                try:
                    if endpoint == "generate":
                        yield parse_chunk(answer(_json(response.content)).get, time.perf_counter() - started)
                        return
                    for line in response.iter_lines(chunk_size=None):
                        if line.startswith(b"data:"):
                            yield parse_chunk(answer(_json(line[5:])).get, time.perf_counter() - started)
                        elif line.strip() and response.status_code >= 400:  # an error answered as plain JSON
                            answer(_json(line))
                except Exception as exc:
                    if generation.cancelled:  # reading a closed response fails in several ways
                        return
                    if isinstance(exc, requests.RequestException):
                        raise GenerationError(f"'{model}': connection lost: {exc}") from None
                    raise
                if response.status_code >= 400:
                    answer({})

        generation = Generation(chunks(), response.close, started)
        return generation


def _json(text: bytes) -> dict:
    try:
        body = json.loads(text)
    except ValueError:
        return {"error": text.decode("utf-8", errors="replace").strip() or "empty answer"}
    return body if isinstance(body, dict) else {"error": f"unexpected answer: {body!r}"}
