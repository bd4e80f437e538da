"""The FastAPI app: OpenAI's routes in front of the Triton models, errors in OpenAI's body.

    GET  /v1/models                  the models Triton serves and has ready, by their Triton names, with max_model_len
    GET  /v1/models/{model}
    POST /v1/completions             a prompt, as text
    POST /v1/chat/completions        messages, rendered with the model folder's chat template
    POST /v1/responses               OpenAI's Responses API: text input rendered as chat's messages, nothing stored
    POST /tokenize, /detokenize      vLLM's: a prompt or messages -> token ids and their count; token ids -> text
    GET  /health                     200 while Triton is live, else 503
    GET  /health/ready               200 while Triton is ready (every model loaded) and the server is not about to
                                     stop (``draining``), else 503
    GET  /get_load                   {"load": N}: the requests this replica holds (for routers that balance by load)

With an API key configured, every ``/v1`` route wants ``Authorization: Bearer <key>`` (401 otherwise); the health
routes stay open for probes. While Triton is away (dead, restarting, or hung: ``triton_health.py`` probes it in the
background) every route but ``/get_load`` answers 503 at once, and serves again once Triton is back. Every error, a
bug included, is answered in OpenAI's body for that request only.
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
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from backend.contract import names, prometheus
from frontend.openai import context_length
from frontend.openai.chat_template import ChatTemplate
from frontend.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest, bad_request
from frontend.openai.responses_api import ResponseAnswer, ResponsesRequest, render
from frontend.openai.serving import Answer
from frontend.openai.tokenize import (
    ChatTokenizeRequest,
    CompletionTokenizeRequest,
    DetokenizeRequest,
    detokenize,
    max_model_len,
    tokenize,
)
from frontend.openai.triton_bridge import TritonBridge
from frontend.openai.triton_health import TritonHealth

log = logging.getLogger("frontend.openai")
OWNED_BY = "triton"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went away (nobody reads it)
T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    triton_grpc_url: str
    model_dir: str
    api_key: str | None = None
    triton_metrics_url: str | None = None  # Triton's metrics page, read by /get_load


def create_app(settings: Settings) -> FastAPI:
    """The app: a Triton bridge that opens with the app's event loop and closes with it, every error in OpenAI's body,
    the health routes open to probes, and OpenAI's routes behind the API key (when one is set)."""
    template = ChatTemplate(settings.model_dir)  # NOTE: here, so that a model folder without one stops the start
    app = FastAPI(title="OpenAI-compatible frontend for the Triton LLM models",
                  lifespan=bridge_lifespan(settings.triton_grpc_url))
    add_error_handlers(app)
    add_health_routes(app)
    add_load_route(app, settings.triton_metrics_url)
    v1 = [Depends(api_key_check(settings.api_key)), Depends(triton_present)]
    app.state.tokenizer = template.tokenizer  # for the requests' length checks
    add_model_routes(app, v1, int(time.time()))
    add_generation_routes(app, v1, template)
    add_tokenizer_routes(app, v1, template)
    return app


def bridge_lifespan(triton_grpc_url: str):
    """The app's lifespan: a :class:`TritonBridge` in ``app.state.bridge`` and Triton's background probe in
    ``app.state.triton_health`` while the app runs. When Triton comes back as a new process, the bridge is made anew
    (its channel would wait out gRPC's reconnection backoff; its streams died with the old process)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.bridge = TritonBridge(triton_grpc_url)
        app.state.triton_health = health = TritonHealth(triton_grpc_url)

        async def renew_bridge() -> None:
            old, app.state.bridge = app.state.bridge, TritonBridge(triton_grpc_url)
            await old.close()

        probe = asyncio.create_task(health.run(renew_bridge), name="triton-health")
        try:
            yield
        finally:
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
            await app.state.bridge.close()

    return lifespan


def bridge_of(request: Request) -> TritonBridge:
    return request.app.state.bridge


async def triton_present(request: Request) -> None:
    """The dependency of the routes that need Triton: 503 at once while the background probe finds it away."""
    health: TritonHealth | None = getattr(request.app.state, "triton_health", None)
    if health is not None and health.away:
        raise APIError(503, f"{health.why_away()}; try again shortly", "server_error", None, "service_unavailable")


def api_key_check(api_key: str | None):
    """The dependency of the ``/v1`` routes: 401 unless the request sends ``Authorization: Bearer <api_key>``
    (nothing to check without a key)."""

    # NOTE: async, so FastAPI runs it on the event loop: a plain def would go through its thread pool, a thread
    # hand-off for every request, which spread a burst of requests over milliseconds before they reached Triton.
    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           "invalid_request_error", None, "invalid_api_key")

    return check_api_key


# ---- errors: every one in OpenAI's body, for that request only ----------------------------------------------------


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_bug)


async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (no such route, a method the route does not take)."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)
    return await on_api_error(request, error)


async def on_bug(request: Request, exc: Exception) -> JSONResponse:
    log.exception("%s %s failed", request.method, request.url.path)
    error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")
    return await on_api_error(request, error)


# ---- the routes ---------------------------------------------------------------------------------------------------


def add_health_routes(app: FastAPI) -> None:
    """``/health``: Triton is live; ``/health/ready``: Triton is ready and the server is not draining
    (:func:`start_draining`). 503 otherwise."""
    app.state.draining = False

    @app.get("/health", dependencies=[Depends(triton_present)])
    async def health(request: Request) -> Response:
        return await triton_health(bridge_of(request), ready=False)

    @app.get("/health/ready", dependencies=[Depends(triton_present)])
    async def ready(request: Request) -> Response:
        if request.app.state.draining:
            raise APIError(503, "this server is about to stop: send new requests elsewhere", "server_error", None,
                           "service_unavailable")
        return await triton_health(bridge_of(request), ready=True)


def start_draining(app: FastAPI) -> None:
    """From now on ``/health/ready`` answers 503, so that routers and load balancers stop sending requests here;
    every request that still comes is served (the launcher's ``--drain-delay``, before the stop)."""
    app.state.draining = True


async def triton_health(bridge: TritonBridge, ready: bool) -> Response:
    """200 while Triton is live (``ready``: while it is ready, every model loaded), else 503."""
    if await (bridge.is_ready() if ready else bridge.is_live()):
        return Response(status_code=200)
    state = "ready" if ready else "live"
    raise APIError(503, f"Triton at {bridge.url} is not {state}", "server_error", None, "service_unavailable")


def add_load_route(app: FastAPI, metrics_url: str | None) -> None:
    """``/get_load``: ``{"load": N}``, the requests this replica holds, for routers that balance by load (vLLM's and
    SGLang's routers poll it for ``power_of_two``). N sums, over Triton's models, the requests in each engine
    (running and waiting: ``llm_num_requests_running``, ``llm_num_requests_waiting``) and those still in Triton's
    queue in front of a model (``nv_inference_pending_request_count``), so it counts every client's requests, not
    just this frontend's. 503 while the metrics page does not answer."""

    @app.get("/get_load")
    async def get_load() -> JSONResponse:
        series = await asyncio.to_thread(prometheus.read, metrics_url, 1.0) if metrics_url else None
        if series is None:
            raise APIError(503, f"Triton's metrics at {metrics_url} do not answer", "server_error", None,
                           "service_unavailable")
        held = (names.NUM_REQUESTS_RUNNING, names.NUM_REQUESTS_WAITING, names.PENDING_REQUESTS)
        load = sum(sum(prometheus.by_model(series, name).values()) for name in held)
        return JSONResponse({"load": int(load)})


def add_model_routes(app: FastAPI, dependencies: list, created: int) -> None:
    """The models Triton serves and has ready, by their Triton names (``created``: when the frontend started), each
    with its ``max_model_len`` (as vLLM's model cards)."""

    async def card(bridge: TritonBridge, model: str) -> dict:
        return model_card(model, created, max_model_len(await bridge.model_config(model)))  # 404 unless served

    @app.get("/v1/models", dependencies=dependencies)
    async def list_models(request: Request) -> JSONResponse:
        bridge = bridge_of(request)
        cards = [await card(bridge, name) for name, ready in await bridge.models() if ready]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model}", dependencies=dependencies)
    async def get_model(model: str, request: Request) -> JSONResponse:
        return JSONResponse(await card(bridge_of(request), model))


def add_tokenizer_routes(app: FastAPI, dependencies: list, template: ChatTemplate) -> None:
    """vLLM's ``/tokenize`` (a prompt, or messages rendered as chat renders them) and ``/detokenize``."""

    async def model_max_len(bridge: TritonBridge, model: str | None) -> int:
        if model is None:  # vLLM's model is optional: every model here serves one folder; the first ready one's
            ready = [name for name, is_ready in await bridge.models() if is_ready]
            if not ready:
                raise APIError(503, "no model is ready", "server_error", None, "model_not_ready")
            model = ready[0]
        return max_model_len(await bridge.model_config(model))

    @app.post("/tokenize", dependencies=dependencies)
    async def tokenize_route(raw: Request) -> JSONResponse:
        body = await raw.body()
        kind = ChatTokenizeRequest if b'"messages"' in body else CompletionTokenizeRequest
        request = validated(kind, body)
        return JSONResponse(tokenize(template, request, await model_max_len(bridge_of(raw), request.model)))

    @app.post("/detokenize", dependencies=dependencies)
    async def detokenize_route(raw: Request) -> JSONResponse:
        request = validated(DetokenizeRequest, await raw.body())
        if request.model is not None:
            await bridge_of(raw).model_config(request.model)  # 404 unless served
        return JSONResponse(detokenize(template, request))


def add_generation_routes(app: FastAPI, dependencies: list, template: ChatTemplate) -> None:
    """``/v1/completions`` (a prompt, as text), ``/v1/chat/completions`` (messages, rendered with ``template``) and
    ``/v1/responses`` (input rendered as chat's messages)."""

    @app.post("/v1/completions", dependencies=dependencies)
    async def completions(raw: Request) -> Response:
        request = parse_body(CompletionRequest, await raw.body())
        return await answer(raw, "completion", request, request.prompt_text())

    @app.post("/v1/chat/completions", dependencies=dependencies)
    async def chat_completions(raw: Request) -> Response:
        request = parse_body(ChatCompletionRequest, await raw.body())
        return await answer(raw, "chat", request, template.render(request.messages, request.tool_calling))

    @app.post("/v1/responses", dependencies=dependencies)
    async def responses(raw: Request) -> Response:
        request = parse_body(ResponsesRequest, await raw.body())
        return await answer(raw, "response", request, render(template, request), ResponseAnswer.start)


async def answer(raw: Request, kind: str, request: SamplingRequest, prompt: str, start=Answer.start) -> Response:
    """The generation's answer (``start``: what sends it, the Responses API's or chat's and completions'): a stream of
    server-sent events, or the whole answer as JSON; a client that went away before either began gets nothing
    (``CLIENT_CLOSED_REQUEST``)."""
    bridge = bridge_of(raw)
    await check_context_length(raw, request, prompt)
    if request.stream:
        # NOTE: once streaming, Starlette cancels the events when the client goes away; until the first token,
        # the watch here does.
        generation = await unless_disconnected(raw, start(bridge, kind, request.model, request, prompt))
        if generation is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return StreamingResponse(generation.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def whole():
        generation = await start(bridge, kind, request.model, request, prompt)
        return await generation.whole()

    whole = await unless_disconnected(raw, whole())
    if whole is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # NOTE: by alias: the SDK's types name a field `schema_` where OpenAI's JSON says "schema"
    return Response(whole.model_dump_json(exclude_unset=True, by_alias=True), media_type="application/json")


async def check_context_length(raw: Request, request: SamplingRequest, prompt: str) -> None:
    """A 400 in tokens, naming the parameters as the client sent them, for a request the model's context cannot
    hold (``context_length.py``); a 404 for a model Triton does not serve."""
    config = await bridge_of(raw).model_config(request.model)
    limit = max_model_len(config)
    context_length.check_max_tokens(request.requested_max_tokens, request.max_tokens_param, limit)
    await context_length.check_prompt(raw.app.state.tokenizer, prompt, request.PROMPT_PARAM, limit)


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


def model_card(name: str, created: int, max_model_len: int) -> dict:
    card = Model(id=name, object="model", created=created, owned_by=OWNED_BY).model_dump(exclude_unset=True)
    return {**card, "max_model_len": max_model_len}


def parse_body(kind: type[SamplingRequest], body: bytes) -> SamplingRequest:
    """The request in ``body`` (JSON, whatever the Content-Type says, as OpenAI reads it), checked for what the
    engine cannot honour."""
    request = validated(kind, body)
    request.check_supported()
    return request


def validated(kind: type[BaseModel], body: bytes) -> BaseModel:
    """``body`` (JSON) as ``kind``; a 400 that names what is wrong."""
    try:
        return kind.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


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
