"""The FastAPI application of the gateway: routes, OpenAI-shaped errors, metrics, disconnects.

::

    POST /v1/completions        OpenAI Completions (stream: Server-Sent Events)
    POST /v1/chat/completions   OpenAI Chat Completions (the checkpoint's chat template)
    GET  /v1/models             the one model this cluster serves
    GET  /v1/models/{model}     its card (404 for another id)
    POST /tokenize              vLLM's: a prompt or a conversation -> token ids
    POST /detokenize            vLLM's: token ids -> text
    GET  /version               pdserve's version
    GET  /metrics               the gateway's own metrics (Prometheus text)
    GET  /health                200 while the router's gRPC health check says SERVING, else 503

Every route but ``/health`` takes the caller's key as a generation does.

A generation request goes through, in order: the caller's key (``Authorization: Bearer KEY``,
``api_key_of``), which the router must admit (``Gateway.admit``; a 401 otherwise), from the
headers alone; the body, read up to ``--max-body-bytes`` (``body.read_body``; a 413 otherwise);
then its preparation and the router calls (``Gateway.completions``/``chat``). So nothing of a
body is read, parsed, rendered or tokenized for a caller the router refuses, or past the size
limit. The key also travels with each router call of the request; ``/v1/models`` asks the
router (``GetModelInfo``) with the caller's key, so it is gated alike; ``/health`` takes no key.

Every error is ``{"error": {"message", "type", "param", "code"}}``, a failure of the gateway
itself included (500 ``server_error``): a body that does not validate is a 400 naming the
parameter (``messages[0].role``), and router errors take their status from
``errors.from_client_error``. An answer given before the whole body was read closes the
connection when the rest may be large (413, or a 401 to a body without a length or over the
limit); otherwise the rest is read and dropped, so the client sees the answer. A client that
disconnects cancels its request in the cluster: a stream's generator is closed by Starlette, a
unary answer is raced against the connection's ``http.disconnect``
(``calls.until_disconnect``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve import __version__
from pdserve.client import ModelInfo
from pdserve.gateway.body import BodyGone, read_body
from pdserve.gateway.calls import ClientDisconnected
from pdserve.gateway.endpoints import Gateway
from pdserve.gateway.errors import (
    BAD_REQUEST,
    NOT_FOUND,
    SERVER_ERROR,
    UNAVAILABLE,
    GatewayError,
    Status,
    unauthorized,
)
from pdserve.gateway.responses import ModelList, VersionResponse
from pdserve.security.auth import bearer
from pdserve.telemetry.metrics import GatewayMetrics

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
          "/version", "/metrics", "/health")  # fmt: skip
MODEL_ROUTE = "/v1/models/{model}"
"""The metrics' label of ``GET /v1/models/ID`` (never the id itself)."""
CLIENT_CLOSED = 499
"""Logged status of a request whose client went away (nobody reads the answer)."""


def _error_response(err: GatewayError) -> JSONResponse:
    headers = {"connection": "close"} if err.close else None
    return JSONResponse(
        err.body().model_dump(mode="json"), status_code=err.status.http, headers=headers
    )


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
            if path.startswith("/v1/models/"):
                route = MODEL_ROUTE
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

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        status = NOT_FOUND if err.status_code == 404 else Status(err.status_code, BAD_REQUEST.type)
        return _error_response(GatewayError(status, str(err.detail)))

    @app.exception_handler(ClientDisconnected)
    @app.exception_handler(BodyGone)
    async def _gone(request: Request, err: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _failed(request: Request, err: Exception) -> JSONResponse:
        # Starlette logs the traceback; the client gets OpenAI's shape, not plain text.
        return _error_response(GatewayError(SERVER_ERROR, "the gateway failed on this request"))

    async def admitted_body(request: Request) -> tuple[str | None, ModelInfo, bytes]:
        """The caller's key and the router's ``ModelInfo``, once the router admits the key,
        and then the body (see the module docstring for the order)."""
        try:
            key = api_key_of(request)
            info = await gateway.admit(key)
        except GatewayError as err:
            # The rest of the body is drained unless it may be large.
            length = request.headers.get("content-length", "")
            err.close = not (length.isdigit() and int(length) <= gateway.config.max_body_bytes)
            raise
        return key, info, await read_body(request, gateway.config.max_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        if await gateway.healthy():
            return JSONResponse({"status": "ok"})
        return _error_response(GatewayError(UNAVAILABLE, "the router is not serving"))

    @app.get("/v1/models", response_model=None)
    async def models(request: Request) -> JSONResponse:
        listing: ModelList = await gateway.models(api_key_of(request))
        return _json(listing)

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(request: Request, model_id: str) -> JSONResponse:
        return _json(await gateway.model(model_id, api_key_of(request)))

    @app.get("/version", response_model=None)
    async def version(request: Request) -> JSONResponse:
        await gateway.admit(api_key_of(request))
        return _json(VersionResponse(version=__version__))

    @app.get("/metrics", response_model=None)
    async def metrics_route(request: Request) -> Response:
        await gateway.admit(api_key_of(request))
        if metrics is None:
            raise GatewayError(NOT_FOUND, "this gateway keeps no metrics")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # The handlers take the Request alone, so FastAPI reads no body before they run.
    @app.post("/tokenize", response_model=None)
    async def tokenize(request: Request) -> JSONResponse:
        _, info, raw = await admitted_body(request)
        return _json(await gateway.tokenize(raw, info))

    @app.post("/detokenize", response_model=None)
    async def detokenize(request: Request) -> JSONResponse:
        _, _, raw = await admitted_body(request)
        return _json(await gateway.detokenize(raw))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        key, _, raw = await admitted_body(request)
        answer = await gateway.completions(raw, lambda: _disconnected(request), key)
        if isinstance(answer, BaseModel):
            return _json(answer)
        return StreamingResponse(answer, media_type="text/event-stream")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        key, _, raw = await admitted_body(request)
        answer = await gateway.chat(raw, lambda: _disconnected(request), key)
        if isinstance(answer, BaseModel):
            return _json(answer)
        return StreamingResponse(answer, media_type="text/event-stream")

    if metrics is not None:
        app.add_middleware(_Metrics, metrics=metrics)
    return app
