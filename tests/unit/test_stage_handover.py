"""Stage boundaries cross a real grpc.aio socket: forward as baggage, backward as trailers.

A caller makes a call inside ``handing_over(t, root)``; the service, served with the tracing
interceptors and ``StageEndInterceptor``, must see ``t`` as its stage start and ``root`` as
its stage parent, and the end it marks must come back in the call's trailing metadata.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.rpc.server import build_server
from pdserve.telemetry import handover
from pdserve.telemetry.tracing import client_interceptors, server_interceptors

SERVICE = "test.Stages"
OWN_START = 2_000_000_000_000_000_000  # later than any handed-over time below
MARKED_END = 1_900_000_000_000_000_123


async def _serve_and_call(
    provider: TracerProvider, handed_ns: int | None, mark: bool
) -> tuple[dict[str, Any], int | None, trace.SpanContext]:
    seen: dict[str, Any] = {}

    async def unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        seen["start"] = handover.stage_start(OWN_START)
        parent = handover.stage_parent()
        seen["parent"] = None if parent is None else trace.get_current_span(parent)
        if mark:
            handover.mark_stage_end(MARKED_END)
        return request

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(unary)}
    )
    server, port, _ = build_server(
        [(lambda _servicer, srv: srv.add_generic_rpc_handlers((handler,)), None)],
        port=0,
        interceptors=[*server_interceptors(provider), handover.StageEndInterceptor()],
    )
    await server.start()
    tracer = provider.get_tracer("test")
    # As in the router: the calls hang off the current (SERVER) span of the trace, the stage
    # root is a child of it that is not current.
    outer = tracer.start_span("router call")
    outer_ctx = trace.set_span_in_context(outer)
    root = tracer.start_span("router.request", context=outer_ctx)
    token = otel_context.attach(outer_ctx)
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", interceptors=client_interceptors(provider)
        ) as channel:
            stub = channel.unary_unary(f"/{SERVICE}/Call")
            if handed_ns is None:
                call = stub(b"x")
            else:
                with handover.handing_over(handed_ns, root):
                    call = stub(b"x")
            assert await call == b"x"
            end = await handover.stage_end_of(call)
    finally:
        otel_context.detach(token)
        root.end()
        outer.end()
        await server.stop(None)
    return seen, end, root.get_span_context()


@pytest.fixture
def provider() -> TracerProvider:
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    return p


def test_the_handed_over_start_and_root_reach_the_callee_and_its_end_comes_back(
    provider: TracerProvider,
) -> None:
    handed = 1_800_000_000_000_000_000
    seen, end, root = asyncio.run(_serve_and_call(provider, handed, mark=True))
    assert seen["start"] == handed
    parent = seen["parent"].get_span_context()
    assert (parent.trace_id, parent.span_id) == (root.trace_id, root.span_id)
    assert end == MARKED_END


def test_without_a_hand_over_the_callee_keeps_its_own_times(provider: TracerProvider) -> None:
    seen, end, _ = asyncio.run(_serve_and_call(provider, None, mark=False))
    assert seen["start"] == OWN_START
    assert seen["parent"] is None
    assert end is None


def test_a_start_after_the_callees_own_is_ignored(provider: TracerProvider) -> None:
    seen, _, _ = asyncio.run(_serve_and_call(provider, OWN_START + 1, mark=False))
    assert seen["start"] == OWN_START  # a clock ahead never makes a stage run backwards


def test_outside_any_call_the_helpers_do_nothing() -> None:
    handover.mark_stage_end(MARKED_END)  # no call being served: ignored, no error
    assert handover.stage_start(OWN_START) == OWN_START
    assert handover.stage_parent(otel_context.get_current()) is otel_context.get_current()
