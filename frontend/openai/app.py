"""The FastAPI app: OpenAI's routes in front of the Triton models, errors in OpenAI's body.

    GET  /v1/models                  the models Triton serves and has ready, by their Triton names
    GET  /v1/models/{model}
    POST /v1/completions             a prompt, as text
    POST /v1/chat/completions        messages, rendered with the model folder's chat template
    GET  /health                     200 while Triton is live, else 503
    GET  /health/ready               200 while Triton is ready (every model loaded), else 503

With an API key configured, every ``/v1`` route wants ``Authorization: Bearer <key>`` (401 otherwise); the health
routes stay open for probes. Every error, a bug included, is answered in OpenAI's body for that request only.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Awaitable, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from openai.types import Model
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from frontend.openai.chat_template import ChatTemplate
from frontend.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest, bad_request
from frontend.openai.serving import Answer
from frontend.openai.triton_bridge import TritonBridge

log = logging.getLogger("frontend.openai")
OWNED_BY = "triton"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went away (nobody reads it)
T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    triton_grpc_url: str
    model_dir: str
    api_key: str | None = None


def create_app(settings: Settings) -> FastAPI:
    """The app; the Triton bridge opens with the app's event loop and closes with it."""
    template = ChatTemplate(settings.model_dir)
    started = int(time.time())
    bridge: TritonBridge | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal bridge
        bridge = TritonBridge(settings.triton_grpc_url)
        try:
            yield
        finally:
            await bridge.close()

    # NOTE: async, so FastAPI runs it on the event loop: a plain def would go through its thread pool, a thread
    # hand-off for every request, which spread a burst of requests over milliseconds before they reached Triton.
    async def check_api_key(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           "invalid_request_error", None, "invalid_api_key")

    app = FastAPI(title="OpenAI-compatible frontend for the Triton LLM models", lifespan=lifespan)
    v1 = [Depends(check_api_key)]

    # -- errors

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)
        return await on_api_error(request, error)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")
        return await on_api_error(request, error)

    # -- health

    @app.get("/health")
    async def health() -> Response:
        if await bridge.is_live():
            return Response(status_code=200)
        raise APIError(503, f"Triton at {bridge.url} is not live", "server_error", None, "service_unavailable")

    @app.get("/health/ready")
    async def ready() -> Response:
        if await bridge.is_ready():
            return Response(status_code=200)
        raise APIError(503, f"Triton at {bridge.url} is not ready", "server_error", None, "service_unavailable")

    # -- models

    @app.get("/v1/models", dependencies=v1)
    async def list_models() -> JSONResponse:
        cards = [model_card(name, started) for name, ready in await bridge.models() if ready]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model}", dependencies=v1)
    async def get_model(model: str) -> JSONResponse:
        await bridge.max_batch_size(model)  # 404 unless served
        return JSONResponse(model_card(model, started))

    # -- generation

    async def answer(raw: Request, kind: str, request: SamplingRequest, prompt: str) -> Response:
        if request.stream:
            # NOTE: once streaming, Starlette cancels the events when the client goes away; until the first token,
            # the watch here does.
            generation = await unless_disconnected(raw, Answer.start(bridge, kind, request.model, request, prompt))
            if generation is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return StreamingResponse(generation.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        async def whole():
            generation = await Answer.start(bridge, kind, request.model, request, prompt)
            return await generation.whole()

        whole = await unless_disconnected(raw, whole())
        if whole is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return Response(whole.model_dump_json(exclude_unset=True), media_type="application/json")

    @app.post("/v1/completions", dependencies=v1)
    async def completions(raw: Request) -> Response:
        request = parse_body(CompletionRequest, await raw.body())
        return await answer(raw, "completion", request, request.prompt_text())

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(raw: Request) -> Response:
        request = parse_body(ChatCompletionRequest, await raw.body())
        return await answer(raw, "chat", request, template.render(request.messages))

    return app


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None once the client has gone away first: then ``work`` is cancelled, and with it its
    Triton request (the models free its KV blocks), as for a client that leaves mid-stream."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        done, _ = await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request's handler was cancelled (the server stopping)
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # its Triton request is cancelled on the way out
    return None


async def _disconnected(raw: Request) -> None:
    """Returns when the client closes its connection (the body has been read, so nothing else arrives)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def model_card(name: str, created: int) -> dict:
    return Model(id=name, object="model", created=created, owned_by=OWNED_BY).model_dump(exclude_unset=True)


def parse_body(kind: type[SamplingRequest], body: bytes) -> SamplingRequest:
    """The request in ``body`` (JSON, whatever the Content-Type says, as OpenAI reads it), checked for what the
    engine cannot honour."""
    try:
        request = kind.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    request.check_supported()
    return request


def validation_error(errors: list[dict]) -> APIError:
    """What is wrong with the body, named as OpenAI names it (``param``: the field's path). Of a union's errors
    (one per member), the deepest: the member the client most likely meant."""
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    where = [str(part) for part in first.get("loc", ()) if not _is_union_member(part)]
    param = ".".join(where) or None
    if first.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unsupported_parameter")
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    return bad_request(f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param)


def _is_union_member(part) -> bool:
    """pydantic names a union's member in the error's location ("str", "list[TextPart]"): not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list") or "[" in part)
