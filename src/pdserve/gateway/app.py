"""The FastAPI application of the gateway: routes, OpenAI-shaped errors, metrics, disconnects.

::

    POST /v1/completions        OpenAI Completions (stream: Server-Sent Events)
    POST /v1/chat/completions   OpenAI Chat Completions (the checkpoint's chat template)
    GET  /v1/models             the one model this cluster serves
    GET  /health                200 while the router's gRPC health check says SERVING, else 503

The caller's ``Authorization: Bearer KEY`` travels with each router call of its request
(``api_key_of``); a router with API keys refuses a missing or unknown one, which answers 401.
``/v1/models`` asks the router (``GetModelInfo``) with the caller's key, so it is gated alike;
``/health`` takes no key.

Every error is ``{"error": {"message", "type", "param", "code"}}``: a body that does not
validate is a 400 naming the parameter (``messages[0].role``), and router errors take their
status from ``errors.from_client_error``. A client that disconnects cancels its request in the
cluster: a stream's generator is closed by Starlette, a unary answer is raced against the
connection's ``http.disconnect`` (``endpoints.until_disconnect``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.gateway.endpoints import ClientDisconnected, Gateway
from pdserve.gateway.errors import (
    BAD_REQUEST,
    NOT_FOUND,
    UNAVAILABLE,
    GatewayError,
    Status,
    bad_request,
    unauthorized,
)
from pdserve.gateway.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.gateway.responses import ModelList
from pdserve.security.auth import bearer
from pdserve.telemetry.metrics import GatewayMetrics

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")
CLIENT_CLOSED = 499
"""Logged status of a request whose client went away (nobody reads the answer)."""

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _param_of(loc: tuple[int | str, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``messages[0].role``; union member tags that
    pydantic adds (``list[int]``, ``str``) end the path."""
    path = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
        else:
            break
    return path or None


def _error_response(err: GatewayError) -> JSONResponse:
    return JSONResponse(err.body().model_dump(mode="json"), status_code=err.status.http)


def _json(model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"))


def api_key_of(request: Request) -> str | None:
    """The caller's key from ``Authorization: Bearer KEY``; None without one. A key that gRPC
    metadata cannot carry (not printable ASCII) is refused here, as the router would."""
    key = bearer(request.headers.items())
    if not key:
        return None
    if not (key.isascii() and key.isprintable()):
        raise unauthorized(api_key_sent=True)
    return key


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the body was read already, so the
    next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Metrics:
    """ASGI middleware: one ``GatewayMetrics`` observation per answered request."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = CLIENT_CLOSED

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            path = scope.get("path", "")
            route = path if path in ROUTES else "other"
            self.metrics.observe_request(route, status, time.perf_counter() - start)


def create_app(
    gateway: Gateway,
    metrics: GatewayMetrics | None = None,
    *,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """The ASGI app serving ``gateway``; ``on_ready`` runs once it can take requests, and the
    gateway's channel is closed at shut-down."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, err: GatewayError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors: list[Any] = list(err.errors())
        first = errors[0] if errors else {}
        loc = tuple(first.get("loc", ()))
        message = str(first.get("msg", "invalid request"))
        if first.get("type") in ("json_invalid", "model_attributes_type"):
            return _error_response(bad_request(None, f"the body is not a JSON object: {message}"))
        return _error_response(bad_request(_param_of(loc), message))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        status = NOT_FOUND if err.status_code == 404 else Status(err.status_code, BAD_REQUEST.type)
        return _error_response(GatewayError(status, str(err.detail)))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, err: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    @app.get("/health")
    async def health() -> Response:
        if await gateway.healthy():
            return JSONResponse({"status": "ok"})
        return _error_response(GatewayError(UNAVAILABLE, "the router is not serving"))

    @app.get("/v1/models", response_model=None)
    async def models(request: Request) -> JSONResponse:
        listing: ModelList = await gateway.models(api_key_of(request))
        return _json(listing)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        answer = await gateway.completions(
            body, lambda: _disconnected(request), api_key_of(request)
        )
        if isinstance(answer, BaseModel):
            return _json(answer)
        return StreamingResponse(answer, media_type="text/event-stream")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        answer = await gateway.chat(body, lambda: _disconnected(request), api_key_of(request))
        if isinstance(answer, BaseModel):
            return _json(answer)
        return StreamingResponse(answer, media_type="text/event-stream")

    if metrics is not None:
        app.add_middleware(_Metrics, metrics=metrics)
    return app
