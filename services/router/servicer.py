"""The Router gRPC service: translates pdserve.v1 messages to and from ``RequestFlow`` calls.

Each call is one ``router.request`` span with the router's latency metrics
(``pdserve.router.telemetry``): it starts when the call arrives, before the prompt is
validated and tokenized, and ends as the last chunk is handed to gRPC; the flow's clean-up
(releasing the reservation) runs after it, as the client already has its answer. A unary
call's answer leaves only when the handler returns, so its span includes the clean-up.

The tenant of a call (placement, quotas, prefix-cache isolation, metrics): with API keys
configured, the tenant of the caller's key, whatever the request says; without, the
``x-pdserve-tenant`` metadata, else ``GenerateRequest.tenant`` (the insecure local mode).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

from grpc.aio import ServicerContext

from pdserve.adapters.router import generate_chunk, generate_response
from pdserve.convert import sampling_from_proto
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import UnauthenticatedError
from pdserve.router import RequestFlow, RequestPreparer, RouteRequest
from pdserve.router.limits import check_message
from pdserve.router.telemetry import RouterTelemetry
from pdserve.security.apikeys import ApiKeys
from pdserve.security.auth import bearer
from pdserve.v1 import router_pb2, router_pb2_grpc

TENANT_METADATA_KEY = "x-pdserve-tenant"
"""gRPC metadata key naming the tenant; takes precedence over GenerateRequest.tenant. Ignored
when the router has API keys (the key names the tenant)."""

Context: TypeAlias = ServicerContext[Any, Any]


def _tenant(context: Context, api_keys: ApiKeys | None, requested: str = "") -> str:
    metadata = context.invocation_metadata() or ()
    if api_keys is not None:
        tenant = api_keys.tenant_of(bearer(metadata))
        if tenant is None:  # the server's AuthInterceptor refuses such calls first
            raise UnauthenticatedError(api_keys.refusal())
        return tenant
    for key, value in metadata:
        if key == TENANT_METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return requested


class RouterServicer(router_pb2_grpc.RouterServicer):
    """pdserve.v1.Router on top of one RequestFlow."""

    def __init__(
        self,
        flow: RequestFlow,
        preparer: RequestPreparer,
        telemetry: RouterTelemetry | None = None,
        *,
        api_keys: ApiKeys | None = None,
    ) -> None:
        self.flow = flow
        self.preparer = preparer
        self.telemetry = telemetry or RouterTelemetry()
        self.api_keys = api_keys

    async def _route(
        self, request: router_pb2.GenerateRequest, context: Context, tenant: str
    ) -> RouteRequest:
        # Sizes first, by counts: nothing large is copied out of the message before this.
        check_message(request, self.preparer.limits, tenant=tenant)
        which = request.WhichOneof("prompt")
        params = (
            sampling_from_proto(request.sampling)
            if request.HasField("sampling")
            else SamplingParams()
        )
        return await self.preparer.prepare(
            text=request.text if which == "text" else None,
            token_ids=request.token_ids.ids if which == "token_ids" else None,
            params=params,
            request_id=request.request_id if request.HasField("request_id") else None,
            tenant=tenant,
            skip_special_tokens=request.skip_special_tokens,
        )

    async def Generate(  # noqa: N802 - gRPC method names
        self, request: router_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[router_pb2.GenerateChunk]:
        tenant = _tenant(context, self.api_keys, request.tenant)
        async with contextlib.AsyncExitStack() as cleanup:
            with self.telemetry.request(tenant) as observed:
                route = await self._route(request, context, tenant)
                observed.prepared(route)
                stream = self.flow.generate(
                    route, timeout_s=context.time_remaining(), observed=observed
                )
                # Closed after the span: the clean-up is not part of the client's latency.
                cleanup.push_async_callback(stream.aclose)
                first = True
                async for chunk in stream:
                    observed.chunk(chunk)
                    message = generate_chunk(chunk, first=first)
                    first = False
                    if chunk.finished:
                        observed.finish()  # the last chunk goes out now
                    yield message
                    if chunk.finished:
                        break

    async def GenerateUnary(  # noqa: N802
        self, request: router_pb2.GenerateRequest, context: Context
    ) -> router_pb2.GenerateResponse:
        tenant = _tenant(context, self.api_keys, request.tenant)
        with self.telemetry.request(tenant) as observed:
            route = await self._route(request, context, tenant)
            observed.prepared(route)
            # The answer leaves only when the handler returns, clean-up included.
            total = await self.flow.collect(
                route, timeout_s=context.time_remaining(), observed=observed
            )
        return generate_response(total)

    async def GetModelInfo(  # noqa: N802
        self, request: router_pb2.GetModelInfoRequest, context: Context
    ) -> router_pb2.ModelInfo:
        # A router with keys refuses a call without a valid one before it reaches here
        # (AuthInterceptor), so this also tells a caller whether its key is accepted.
        return router_pb2.ModelInfo(
            max_model_len=self.preparer.model.max_model_len,
            max_prompt_tokens=self.preparer.limits.max_prompt_tokens,
            tenant=_tenant(context, self.api_keys),
        )
