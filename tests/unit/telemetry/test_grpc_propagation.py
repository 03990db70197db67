"""Trace context crosses a real grpc.aio socket through the interceptor helpers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pdserve.errors import WorkerUnavailableError
from pdserve.rpc.server import build_server
from pdserve.telemetry.tracing import client_interceptors, server_interceptors, stage_span

SERVICE = "test.Echo"


def _handler(provider: TracerProvider) -> grpc.GenericRpcHandler:
    async def unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        if request == b"gone":
            raise WorkerUnavailableError("decode worker gone")
        with stage_span("prefill.queue", tracer_provider=provider):
            await asyncio.sleep(0)
        with stage_span("prefill.compute", tracer_provider=provider):
            await asyncio.sleep(0)
        return request

    async def stream(
        request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        with stage_span("decode.generate", tracer_provider=provider):
            for _ in range(3):
                await asyncio.sleep(0)
                yield request

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
        },
    )


async def _serve_and_call(
    provider: TracerProvider, payloads: Sequence[bytes]
) -> tuple[list[bytes], grpc.StatusCode | None]:
    """Serve the echo service with pdserve's server plumbing; call it once per payload."""
    handler = _handler(provider)
    server, port, health = build_server(
        [(lambda _servicer, srv: srv.add_generic_rpc_handlers((handler,)), None)],
        port=0,
        interceptors=server_interceptors(provider),
    )
    await server.start()
    await health.set_serving()
    failed: grpc.StatusCode | None = None
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", interceptors=client_interceptors(provider)
        ) as channel:
            checked = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest()
            )
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
            unary = channel.unary_unary(f"/{SERVICE}/Unary")
            stream = channel.unary_stream(f"/{SERVICE}/Stream")

            async def one(payload: bytes) -> bytes:
                nonlocal failed
                tracer = provider.get_tracer("client")
                with tracer.start_as_current_span(f"caller {payload.decode()}"):
                    try:
                        first = await unary(payload)
                    except grpc.aio.AioRpcError as err:
                        failed = err.code()
                        return b""
                    rest = [chunk async for chunk in stream(payload)]
                    return first + b"".join(rest)

            return list(await asyncio.gather(*(one(p) for p in payloads))), failed
    finally:
        await server.stop(None)


def _by_id(spans: Sequence[ReadableSpan]) -> dict[int, ReadableSpan]:
    return {s.context.span_id: s for s in spans}


def _parent(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> ReadableSpan:
    assert span.parent is not None, span.name
    return by_id[span.parent.span_id]


def test_server_spans_continue_the_callers_trace(
    provider: TracerProvider, memory_exporter: InMemorySpanExporter
) -> None:
    payloads = [b"a", b"b", b"c", b"d"]
    results, failed = asyncio.run(_serve_and_call(provider, payloads))
    assert results == [p * 4 for p in payloads] and failed is None
    spans = memory_exporter.get_finished_spans()
    by_id = _by_id(spans)
    assert not [s for s in spans if "Health" in s.name]  # probes are not traced
    callers = [s for s in spans if s.name.startswith("caller ")]
    assert len(callers) == len(payloads)
    assert len({c.context.trace_id for c in callers}) == len(payloads)  # one trace per call
    for caller in callers:
        trace = [s for s in spans if s.context.trace_id == caller.context.trace_id]
        # caller, 2 client spans, 2 server spans, 3 stage spans
        assert len(trace) == 8
        servers = [s for s in trace if s.kind is SpanKind.SERVER]
        assert sorted(s.name for s in servers) == [f"/{SERVICE}/Stream", f"/{SERVICE}/Unary"]
        for server in servers:
            client = _parent(server, by_id)
            assert server.parent is not None and server.parent.is_remote
            assert client.kind is SpanKind.CLIENT and client.name == server.name
            assert _parent(client, by_id) is caller
        for stage in (s for s in trace if s.kind is SpanKind.INTERNAL and s is not caller):
            parent = _parent(stage, by_id)
            assert parent.kind is SpanKind.SERVER
            assert parent.name.endswith("Stream" if stage.name == "decode.generate" else "Unary")
            assert parent.start_time is not None and stage.start_time is not None
            assert parent.end_time is not None and stage.end_time is not None
            assert parent.start_time <= stage.start_time <= stage.end_time <= parent.end_time


def test_a_mapped_error_marks_the_server_span(
    provider: TracerProvider, memory_exporter: InMemorySpanExporter
) -> None:
    # ErrorInterceptor maps the error to UNAVAILABLE by aborting the call; the tracing
    # interceptor sees the abort. (Client-side codes such as RESOURCE_EXHAUSTED leave a server
    # span UNSET, as the OpenTelemetry RPC conventions say; the status code attribute is set.)
    _, failed = asyncio.run(_serve_and_call(provider, [b"gone"]))
    assert failed is grpc.StatusCode.UNAVAILABLE
    (server,) = [s for s in memory_exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert server.status.status_code is StatusCode.ERROR
    assert "decode worker gone" in (server.status.description or "")
    assert server.attributes is not None
    assert server.attributes["rpc.grpc.status_code"] == 14  # UNAVAILABLE on the wire
