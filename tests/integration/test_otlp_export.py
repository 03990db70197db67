"""Spans travel from instrumented grpc.aio services to a real OTLP gRPC receiver.

The receiver is an OTLP ``TraceService`` served by this test on a loopback port. A child
process (tracing installs process-wide state, which must not leak into the test session)
configures tracing from the environment only, serves a small grpc.aio service with
``server_interceptors()``, calls it concurrently through a channel with
``client_interceptors()``, and records nested stage spans inside each call. The test then
checks the exported spans: one connected trace per call, with the right parentage and timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

pytestmark = pytest.mark.integration

N_CALLS = 6
SERVICE_NAME = "pdserve-otlp-pair"

_PAIR = """
import asyncio, sys, time
import grpc
from opentelemetry import context
from pdserve.telemetry import tracing

async def work(request: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
    arrived = time.time_ns()
    server_ctx = context.get_current()
    await asyncio.sleep(0.002)  # let the concurrent calls interleave
    queued_until = time.time_ns()
    attrs = {"pdserve.request_id": request.decode()}
    with tracing.stage_span("prefill.compute", attrs):
        await asyncio.sleep(0.001)
        with tracing.stage_span("kv.transfer.send", attrs):
            await asyncio.sleep(0.001)
    # Timed above, recorded afterwards with explicit times, parented on the server span.
    tracing.record_span("prefill.queue", arrived, queued_until, attrs, server_ctx)
    return request

async def main(n: int) -> None:
    handler = grpc.method_handlers_generic_handler(
        "test.Pair", {"Work": grpc.unary_unary_rpc_method_handler(work)}
    )
    server = grpc.aio.server(interceptors=tracing.server_interceptors())
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", interceptors=tracing.client_interceptors()
        ) as channel:
            call = channel.unary_unary("/test.Pair/Work")
            got = await asyncio.gather(*(call(f"req-{i}".encode()) for i in range(n)))
            assert got == [f"req-{i}".encode() for i in range(n)], got
    finally:
        await server.stop(None)

if tracing.init_tracing(sys.argv[2]) is None:
    sys.exit("tracing is not configured")
asyncio.run(main(int(sys.argv[1])))
tracing.shutdown_tracing()
"""


@dataclass(frozen=True)
class Received:
    """One exported span with its resource's service name."""

    service: str
    span: Span


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.changed = threading.Condition()

    def Export(  # noqa: N802 - the OTLP service's method name
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        batch: list[Received] = []
        for resource_spans in request.resource_spans:
            service = next(
                (
                    kv.value.string_value
                    for kv in resource_spans.resource.attributes
                    if kv.key == "service.name"
                ),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                batch.extend(Received(service, s) for s in scope_spans.spans)
        with self.changed:
            self.spans.extend(batch)
            self.changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, count: int, timeout_s: float) -> list[Received]:
        with self.changed:
            self.changed.wait_for(lambda: len(self.spans) >= count, timeout=timeout_s)
            return list(self.spans)


@pytest.fixture
def receiver() -> Iterator[tuple[_Receiver, int]]:
    servicer = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(None).wait()


def _string_attr(span: Span, key: str) -> str | None:
    return next((kv.value.string_value for kv in span.attributes if kv.key == key), None)


def _inside(child: Span, parent: Span) -> bool:
    return (
        parent.start_time_unix_nano
        <= child.start_time_unix_nano
        <= child.end_time_unix_nano
        <= parent.end_time_unix_nano
    )


def test_concurrent_calls_export_one_connected_trace_each(receiver: tuple[_Receiver, int]) -> None:
    servicer, port = receiver
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PDSERVE_"))}
    # Only the endpoint: the exporter must be chosen from it (OTEL_TRACES_EXPORTER unset).
    env |= {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    pair = subprocess.run(
        [sys.executable, "-c", _PAIR, str(N_CALLS), SERVICE_NAME],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pair.returncode == 0, pair.stderr
    per_call = 5  # client, server, prefill.queue, prefill.compute, kv.transfer.send
    deadline = time.monotonic() + 30.0
    received = servicer.wait_for(N_CALLS * per_call, timeout_s=deadline - time.monotonic())
    assert len(received) == N_CALLS * per_call, [r.span.name for r in received]
    assert {r.service for r in received} == {SERVICE_NAME}

    traces: dict[bytes, list[Span]] = defaultdict(list)
    for r in received:
        traces[r.span.trace_id].append(r.span)
    assert len(traces) == N_CALLS
    request_ids = set()
    for spans in traces.values():
        by_kind = defaultdict(list)
        for s in spans:
            by_kind[s.kind].append(s)
        (client,) = by_kind[Span.SPAN_KIND_CLIENT]
        (server,) = by_kind[Span.SPAN_KIND_SERVER]
        stages = {s.name: s for s in by_kind[Span.SPAN_KIND_INTERNAL]}
        assert sorted(stages) == ["kv.transfer.send", "prefill.compute", "prefill.queue"]
        assert client.name == server.name == "/test.Pair/Work"
        assert client.parent_span_id == b""  # the call is the root of its trace
        assert server.parent_span_id == client.span_id
        assert stages["prefill.queue"].parent_span_id == server.span_id
        assert stages["prefill.compute"].parent_span_id == server.span_id
        assert stages["kv.transfer.send"].parent_span_id == stages["prefill.compute"].span_id
        assert _inside(server, client)
        for name in ("prefill.queue", "prefill.compute"):
            assert _inside(stages[name], server), name
        assert _inside(stages["kv.transfer.send"], stages["prefill.compute"])
        # The queue was recorded after the fact but still ends before compute starts.
        assert (
            stages["prefill.queue"].end_time_unix_nano
            <= stages["prefill.compute"].start_time_unix_nano
        )
        ids = {_string_attr(s, "pdserve.request_id") for s in stages.values()}
        assert len(ids) == 1  # no span strayed into another call's trace
        (request_id,) = ids
        assert request_id is not None
        request_ids.add(request_id)
    assert request_ids == {f"req-{i}" for i in range(N_CALLS)}
