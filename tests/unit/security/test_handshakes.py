"""TLS, mutual TLS and the internal credential over real loopback sockets.

A real grpc.aio server built by ``build_server`` (one unary and one streaming method, health)
and real channels: handshakes that must succeed, and the ones that must fail (no TLS, another
CA, no client certificate, a client certificate of the wrong identity, no or a wrong token).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.rpc.server import build_server
from pdserve.security.auth import InternalAuth
from pdserve.security.certs import ClusterCerts
from pdserve.security.options import INSECURE, SecurityOptions
from pdserve.security.tls import TlsConfig
from pdserve.v1 import decode_pb2, decode_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc


class _Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    async def ListWorkers(  # noqa: N802
        self, request: scheduler_pb2.ListWorkersRequest, context: Any
    ) -> scheduler_pb2.ListWorkersResponse:
        return scheduler_pb2.ListWorkersResponse(workers=[scheduler_pb2.WorkerStatus(id="w-1")])


class _Decode(decode_pb2_grpc.DecodeServicer):
    async def Decode(  # noqa: N802
        self, request: decode_pb2.DecodeRequest, context: Any
    ) -> AsyncIterator[decode_pb2.DecodeChunk]:
        for t in (1, 2, 3):
            yield decode_pb2.DecodeChunk(token_ids=[t])


Scenario = Callable[[str], Awaitable[None]]


def serve(server_side: SecurityOptions, scenario: Scenario) -> None:
    """Run ``scenario(address)`` against a server with ``server_side``'s TLS and internal
    credential check."""

    async def main() -> None:
        server, port, health = build_server(
            [
                (scheduler_pb2_grpc.add_SchedulerServicer_to_server, _Scheduler()),
                (decode_pb2_grpc.add_DecodeServicer_to_server, _Decode()),
            ],
            port=0,
            security=server_side,
            auth=server_side.internal_auth(),
        )
        await server.start()
        await health.set_serving()
        try:
            await asyncio.wait_for(scenario(f"127.0.0.1:{port}"), 30)
        finally:
            await server.stop(None)

    asyncio.run(main())


async def list_workers(channel: grpc.aio.Channel) -> list[str]:
    reply = await scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
        scheduler_pb2.ListWorkersRequest(), timeout=5
    )
    return [w.id for w in reply.workers]


async def decode_tokens(channel: grpc.aio.Channel) -> list[int]:
    call = decode_pb2_grpc.DecodeStub(channel).Decode(decode_pb2.DecodeRequest(), timeout=5)
    return [t async for chunk in call for t in chunk.token_ids]


async def refused(call: Awaitable[object]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


async def health_status(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=5
    )
    return int(reply.status)


def tls_server(
    certs: ClusterCerts, *, client_auth: bool = False, token: str | None = None
) -> SecurityOptions:
    tls = TlsConfig(cert=certs.node_cert, key=certs.node_key, ca=certs.ca, client_auth=client_auth)
    return SecurityOptions(tls=tls, internal_token=token)


def caller(
    certs: ClusterCerts,
    *,
    ca: ClusterCerts | None = None,
    cert: str = "none",
    token: str | None = None,
) -> SecurityOptions:
    """A client: trusting ``ca``'s CA (default ``certs``'), presenting the node or client
    certificate of ``certs`` (or none), sending ``token``."""
    files = {
        "none": (None, None),
        "node": (certs.node_cert, certs.node_key),
        "client": (certs.client_cert, certs.client_key),
    }[cert]
    tls = TlsConfig(cert=files[0], key=files[1], ca=(ca or certs).ca)
    return SecurityOptions(tls=tls, internal_token=token)


def test_tls_handshake_accepted_with_the_cluster_ca(certs: ClusterCerts) -> None:
    async def scenario(address: str) -> None:
        async with caller(certs).aio_channel(address) as channel:
            assert await list_workers(channel) == ["w-1"]
            assert await decode_tokens(channel) == [1, 2, 3]

    serve(tls_server(certs), scenario)


def test_tls_refuses_plaintext_and_a_foreign_ca(
    certs: ClusterCerts, other_certs: ClusterCerts
) -> None:
    async def scenario(address: str) -> None:
        async with INSECURE.aio_channel(address) as plain:
            assert await refused(list_workers(plain)) == grpc.StatusCode.UNAVAILABLE
        # The client trusts another CA: the server's certificate does not verify.
        async with caller(certs, ca=other_certs).aio_channel(address) as foreign:
            assert await refused(list_workers(foreign)) == grpc.StatusCode.UNAVAILABLE

    serve(tls_server(certs), scenario)


def test_plaintext_client_cannot_reach_a_tls_server_even_for_health(
    certs: ClusterCerts,
) -> None:
    async def scenario(address: str) -> None:
        async with INSECURE.aio_channel(address) as plain:
            assert await refused(health_status(plain)) == grpc.StatusCode.UNAVAILABLE
        async with caller(certs).aio_channel(address) as tls:
            assert await health_status(tls) == health_pb2.HealthCheckResponse.SERVING

    serve(tls_server(certs), scenario)


def test_mutual_tls_admits_cluster_members_by_certificate(
    certs: ClusterCerts, other_certs: ClusterCerts
) -> None:
    async def scenario(address: str) -> None:
        # No client certificate: the handshake itself fails.
        async with caller(certs).aio_channel(address) as anonymous:
            assert await refused(list_workers(anonymous)) == grpc.StatusCode.UNAVAILABLE
        # A certificate of another CA: refused by the handshake too.
        async with caller(other_certs, ca=certs, cert="node").aio_channel(address) as stranger:
            assert await refused(list_workers(stranger)) == grpc.StatusCode.UNAVAILABLE
        # The cluster identity, no token: admitted on its certificate, streams included.
        async with caller(certs, cert="node").aio_channel(address) as member:
            assert await list_workers(member) == ["w-1"]
            assert await decode_tokens(member) == [1, 2, 3]

    serve(tls_server(certs, client_auth=True, token="unused-but-configured-0123"), scenario)


def test_mutual_tls_refuses_a_client_certificate_of_another_identity(
    certs: ClusterCerts, token: str
) -> None:
    async def scenario(address: str) -> None:
        # pdserve-client: signed by the cluster's CA (the handshake passes), not a member.
        async with caller(certs, cert="client").aio_channel(address) as user:
            assert await refused(list_workers(user)) == grpc.StatusCode.UNAUTHENTICATED
            assert await refused(decode_tokens(user)) == grpc.StatusCode.UNAUTHENTICATED
            assert await health_status(user) == health_pb2.HealthCheckResponse.SERVING
        # The same certificate with the cluster's token: admitted by the token.
        async with caller(certs, cert="client", token=token).aio_channel(address) as holder:
            assert await list_workers(holder) == ["w-1"]

    serve(tls_server(certs, client_auth=True, token=token), scenario)


def test_internal_token_required_on_every_method_but_health(token: str) -> None:
    server_side = SecurityOptions(internal_token=token)

    async def scenario(address: str) -> None:
        async with INSECURE.aio_channel(address) as anonymous:
            assert await refused(list_workers(anonymous)) == grpc.StatusCode.UNAUTHENTICATED
            assert await refused(decode_tokens(anonymous)) == grpc.StatusCode.UNAUTHENTICATED
            assert await health_status(anonymous) == health_pb2.HealthCheckResponse.SERVING
        wrong = SecurityOptions(internal_token=token[:-1] + ("0" if token[-1] != "0" else "1"))
        async with wrong.aio_channel(address) as guesser:
            assert await refused(list_workers(guesser)) == grpc.StatusCode.UNAUTHENTICATED
        async with server_side.aio_channel(address) as member:
            assert await list_workers(member) == ["w-1"]
            assert await decode_tokens(member) == [1, 2, 3]

    serve(server_side, scenario)


def test_token_travels_as_call_credentials_over_tls(certs: ClusterCerts, token: str) -> None:
    async def scenario(address: str) -> None:
        async with caller(certs).aio_channel(address) as no_token:
            assert await refused(list_workers(no_token)) == grpc.StatusCode.UNAUTHENTICATED
        async with caller(certs, token=token).aio_channel(address) as member:
            assert await list_workers(member) == ["w-1"]
            assert await decode_tokens(member) == [1, 2, 3]

    serve(tls_server(certs, token=token), scenario)


def test_reflection_is_off_unless_asked_for() -> None:
    async def reflected(channel: grpc.aio.Channel, *, ask: bool = True) -> set[str]:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            if ask:
                yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for reply in stub.ServerReflectionInfo(requests(), timeout=20):
            return {s.name for s in reply.list_services_response.service}
        return set()

    async def off(address: str) -> None:
        async with INSECURE.aio_channel(address) as channel:
            # No request message: a write racing the server's immediate UNIMPLEMENTED can
            # surface as INTERNAL in the gRPC core; the method's absence is what is checked.
            assert await refused(reflected(channel, ask=False)) == grpc.StatusCode.UNIMPLEMENTED

    async def on(address: str) -> None:
        async with INSECURE.aio_channel(address) as channel:
            assert "pdserve.v1.Scheduler" in await reflected(channel)

    serve(INSECURE, off)
    serve(replace(INSECURE, reflection=True), on)


def test_internal_auth_is_off_without_a_credential(certs: ClusterCerts) -> None:
    assert INSECURE.internal_auth() is None
    assert tls_server(certs).internal_auth() is None  # TLS alone authenticates nobody
    auth = tls_server(certs, client_auth=True).internal_auth()
    assert auth == InternalAuth(None, frozenset({"pdserve-cluster"}))
