"""Every port a service listens on is exclusive: a port another process holds is a
``BindError`` naming the address, and a service's ``main`` turns it into one line and exit
status 1 (``run_service``). gRPC's default on Linux is SO_REUSEPORT, with which a second server
would bind a served port and take half its connections."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from pdserve.errors import BindError
from pdserve.rpc.server import DEFAULT_OPTIONS, build_server, run_service
from pdserve.telemetry.metrics_http import start_metrics_server

HELD = "another process holds this port"


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port a plain listening socket holds."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield int(sock.getsockname()[1])


def test_a_served_port_refuses_a_second_grpc_server() -> None:
    async def body() -> None:
        first, port, health = build_server([], port=0)
        await first.start()
        await health.set_serving()
        try:
            # Whatever options a caller passes, SO_REUSEPORT stays off.
            for options in (DEFAULT_OPTIONS, (("grpc.so_reuseport", 1),)):
                with pytest.raises(BindError) as info:
                    build_server([], port=port, options=options)
                assert str(info.value) == f"cannot listen on 127.0.0.1:{port}: {HELD}"
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING  # the first serves on
        finally:
            await first.stop(None)

    asyncio.run(body())


def test_a_port_held_by_any_socket_is_a_bind_error(held_port: int) -> None:
    async def build() -> None:
        build_server([], port=held_port)  # a grpc.aio server is made inside an event loop

    with pytest.raises(BindError) as info:
        asyncio.run(build())
    assert info.value.address == f"127.0.0.1:{held_port}"
    assert HELD in str(info.value)


def test_a_metrics_port_held_is_a_bind_error(held_port: int) -> None:
    with pytest.raises(BindError) as info:
        start_metrics_server(CollectorRegistry(), held_port)
    assert str(info.value) == f"cannot listen on http://127.0.0.1:{held_port}/metrics: {HELD}"


def test_run_service_turns_a_bind_error_into_one_line_and_status_1(held_port: int) -> None:
    async def serve() -> None:
        build_server([], port=held_port)

    with pytest.raises(SystemExit) as info:
        run_service("router", serve())
    assert info.value.code == f"router: cannot listen on 127.0.0.1:{held_port}: {HELD}"
    assert info.value.__suppress_context__  # no traceback of the cause is printed
