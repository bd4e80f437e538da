"""Triton's gRPC frontend seen from the OpenAI server: the served models, and one request on its own async stream.

    bridge = TritonBridge("127.0.0.1:8001")
    generation = await bridge.generate("llm_continuous", GenerationRequest("Hi", max_tokens=8, stream=True))
    async for piece in generation:        # Piece: the new text, its token count, the finish reason at the end
        ...
    await generation.aclose()             # ends the Triton request if it has not ended (a client went away)

``tritonclient.grpc.aio``: one bidirectional stream per request on one shared channel, so nothing blocks the event
loop. The request is the only message the stream carries; the models give every request exactly one final response,
the one with a finish reason or an error, after which Triton closes the stream.

A request whose client went away is not cancelled: cancelling a stream can crash Triton 2.51's gRPC frontend
(docs/server.md, "A known crash in Triton 2.51"; triton_workarounds.GRPC_CANCEL_RACE). Its id is posted on the server's
stop board instead (``backend/contract/stop_board.py``): the model ends it before its next step, its KV blocks freed,
and answers it with its final response; the stream, read to its end in the background, then closes the normal way. Only
a server whose board this process cannot see (on another host or in another container) has its streams cancelled.

The models answer every refusal and failure with a message that carries its kind as a code in front
(backend/contract/errors.py, model_repository/README.md); :func:`api_error` maps that kind onto OpenAI's status, type
and code through the contract's one table (a full queue 429, a server going down 503, a prompt or output beyond the
context 400 ``context_length_exceeded``, ...), never through the message's words.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from backend.contract import errors
from backend.contract.stop_board import StopBoard
from client.schema import GenerationRequest, build_inputs
from frontend.openai.logprobs import TokenLogprob, parse_logprobs
from frontend.openai.protocol import APIError

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 5.0  # a finished request's stream: Triton closes it at once
# A stopped request may wait in Triton's queue before a model sees the post (behind a static batch, in a backlog);
# past this its stream is cancelled after all.
STOP_TIMEOUT_S = 60.0


def api_error(message: str, prompt_param: str) -> APIError:
    """The OpenAI error for a model's (or Triton's) error message about one request: the status, type and code of its
    kind, the parameter it names (the prompt's is ``prompt_param``: ``prompt`` or ``messages``), and its text."""
    error = errors.parse(message)
    if error is None:  # neither a model's error nor Triton's full queue: nothing this server's client did
        return APIError(500, message, "server_error", None, "internal_error")
    http = errors.HTTP[error.kind]
    param = prompt_param if error.param == errors.PROMPT else error.param
    return APIError(http.status, error.text, http.type, param, http.code)


def unreachable(url: str, exc: BaseException) -> APIError:
    return APIError(503, f"Triton's gRPC frontend at {url} did not answer: {exc}", "server_error", None,
                    "service_unavailable")


@dataclass(frozen=True)
class Piece:
    """One Triton response: the new text (whole UTF-8 characters only) of one sequence and the counts it carries."""

    text: str
    num_tokens: int
    finish_reason: str | None  # "stop", "length" or "abort" on the sequence's last response
    num_input_tokens: int
    num_output_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked
    index: int = 0  # which of the request's n sequences (OpenAI's choices[i].index)
    # The models' prompt_logprobs JSON (vLLM's: one entry per prompt token, the first None), in the request's first
    # response when it asked
    prompt_logprobs: list[dict | None] | None = None


class TritonGeneration:
    """One request in flight on its own gRPC stream; iterate it for :class:`Piece` s until the final one (once each of
    its ``n`` sequences has had its last)."""

    def __init__(self, call, prompt_param: str, url: str, n: int = 1, request_id: str = "",
                 background: "BackgroundTasks | None" = None) -> None:
        self._call = call
        self._prompt_param = prompt_param
        self._url = url
        self.n = n
        self.request_id = request_id  # the id Triton has for it: its name on the stop board
        self._background = background if background is not None else BackgroundTasks()
        self._closed = False
        self._read: asyncio.Future | None = None  # the stream's next response, being read
        self._decoders = [codecs.getincrementaldecoder("utf-8")() for _ in range(n)]  # one per sequence
        self._num_ended = 0
        self.finished = False
        self.sent_at = time.perf_counter()

    def __aiter__(self) -> "TritonGeneration":
        return self

    async def __anext__(self) -> Piece:
        if self.finished:
            raise StopAsyncIteration
        try:
            result, error = await self._next_response()
        except StopAsyncIteration:
            self.finished = True
            raise APIError(500, "Triton closed the stream before the final response", "server_error") from None
        except grpc.aio.AioRpcError as exc:
            self.finished = True
            raise unreachable(self._url, exc) from None
        if error is not None:
            self.finished = True  # the models end a request with its error
            raise api_error(error.message(), self._prompt_param)
        return self._piece(result)

    def _piece(self, result) -> Piece:
        reason = _first(result.as_numpy("finish_reason"))
        reason = reason.decode() if reason else None
        index = int(_first(result.as_numpy("index")) or 0)
        self._num_ended += bool(reason)
        self.finished = self._num_ended >= self.n
        if reason == "abort":  # ended by the server, not by this client (it would not be reading any more)
            raise APIError(503, "the server aborted the request", "server_error", None, "service_unavailable")
        # NOTE: the models send whole characters; the incremental decoder still holds back a cut one, so no delta
        # ever carries half a character (or U+FFFD in its place).
        text = self._decoders[index].decode(_first(result.as_numpy("text_output")) or b"", final=bool(reason))
        ids = result.as_numpy("output_ids")
        logprobs = _first(result.as_numpy("logprobs"))
        prompt_logprobs = _first(result.as_numpy("prompt_logprobs"))
        return Piece(
            text=text,
            num_tokens=0 if ids is None else int(ids.size),
            finish_reason=reason,
            num_input_tokens=int(_first(result.as_numpy("num_input_tokens")) or 0),
            num_output_tokens=int(_first(result.as_numpy("num_output_tokens")) or 0),
            logprobs=parse_logprobs(logprobs.decode()) if logprobs else (),
            index=index,
            prompt_logprobs=json.loads(prompt_logprobs.decode()) if prompt_logprobs else None,
        )

    async def aclose(self) -> None:
        """End the request if it has not ended (the module's docstring: a post on the stop board, or a cancel where
        there is no board) and read its stream to the end in the background. Returns at once."""
        if self._closed:
            return
        self._closed = True
        board = None
        if not self.finished:
            self.finished = True
            board = StopBoard.find(self._url)
            if board is None or not board.post(self.request_id):
                log.warning("%s: no stop board of its server here; cancelling its stream", self.request_id)
                self._call.cancel()
                return
        self._background.run(self._read_to_end(board))

    async def _read_to_end(self, board: StopBoard | None) -> None:
        try:
            await asyncio.wait_for(self._drain(), DRAIN_TIMEOUT_S if board is None else STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            if board is not None:
                log.warning("%s: did not end within %.0f s of its stop; cancelling its stream", self.request_id,
                            STOP_TIMEOUT_S)
            self._call.cancel()
        except grpc.aio.AioRpcError:  # the stream broke (the server went away): nothing is left to free
            pass
        finally:
            if board is not None:
                board.withdraw(self.request_id)

    async def _next_response(self):
        """The stream's next response. NOTE: shielded, as grpc.aio cancels the whole call when the task reading it
        is cancelled, and that is how a client's disconnect reaches this code (its handler's task is cancelled): the
        read goes on, and the stream is read to its end after the stop (``aclose``)."""
        if self._read is None:
            self._read = asyncio.ensure_future(self._call.__anext__())
        read = self._read
        try:
            return await asyncio.shield(read)
        finally:
            if read.done():
                self._read = None

    async def _drain(self) -> None:
        if self._read is not None:  # a read its reader stopped waiting for
            try:
                await self._read
            except StopAsyncIteration:
                return
        async for _ in self._call:
            pass


class BackgroundTasks:
    """The streams being read to their end after their clients went away: kept referenced until done, and waited
    for (then cancelled) when the bridge closes."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def run(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self, timeout: float) -> None:
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()


class TritonBridge:
    """The Triton server at ``url`` (gRPC): health, the served models, and generations.

    Create it inside the event loop that uses it (the aio channel belongs to that loop).
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = grpcclient.InferenceServerClient(url)
        self._configs: dict[str, dict] = {}
        self.background = BackgroundTasks()

    async def close(self, timeout: float = DRAIN_TIMEOUT_S) -> None:
        await self.background.close(timeout)
        await self.client.close()

    async def is_live(self) -> bool:
        try:
            return await self.client.is_server_live(client_timeout=2.0)
        except InferenceServerException:
            return False

    async def is_ready(self) -> bool:
        try:
            return await self.client.is_server_ready(client_timeout=2.0)
        except InferenceServerException:
            return False

    async def models(self) -> list[tuple[str, bool]]:
        """Every model in Triton's repository index: ``(name, ready)``."""
        try:
            index = await self.client.get_model_repository_index(as_json=True, client_timeout=5.0)
        except InferenceServerException as exc:
            raise unreachable(self.url, exc) from None
        return [(m["name"], m.get("state") == "READY") for m in index.get("models", [])]

    async def max_batch_size(self, model: str) -> int:
        """The model's ``max_batch_size`` (the shape of its inputs)."""
        return int((await self.model_config(model)).get("max_batch_size", 0))

    async def model_config(self, model: str) -> dict:
        """The model's config (config.pbtxt as JSON), asked once per model; 404 for a model Triton does not serve,
        503 for one that is not ready (asked again next time: it may be loaded later)."""
        if model in self._configs:
            return self._configs[model]
        served = dict(await self.models())
        if model not in served:
            names = ", ".join(sorted(served)) or "(none)"
            raise APIError(404, f"The model '{model}' does not exist; served models: {names}", "invalid_request_error",
                           "model", "model_not_found")
        if not served[model]:
            raise APIError(503, f"The model '{model}' is not ready", "server_error", "model", "model_not_ready")
        try:
            config = await self.client.get_model_config(model, as_json=True, client_timeout=5.0)
        except InferenceServerException as exc:
            raise unreachable(self.url, exc) from None
        self._configs[model] = config["config"]
        return self._configs[model]

    async def generate(self, model: str, request: GenerationRequest, prompt_param: str) -> TritonGeneration:
        """Send ``request`` to ``model`` on a stream of its own."""
        inputs = build_inputs(request, await self.max_batch_size(model))
        request_id = f"openai-{uuid.uuid4().hex}"

        async def one_request() -> AsyncIterator[dict]:
            yield {"model_name": model, "inputs": inputs, "priority": request.priority or 0, "request_id": request_id}

        call = self.client.stream_infer(one_request())
        return TritonGeneration(call, prompt_param, self.url, request.n or 1, request_id, self.background)


def _first(array):
    return None if array is None or array.size == 0 else array.reshape(-1)[0]
