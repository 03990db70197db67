"""Bytes that are no valid request message, sent over a real channel to a real server built
by ``build_server``: INVALID_ARGUMENT naming the request, never UNKNOWN "Unexpected
DecodeError"; a valid message still reaches its handler, and so does every message of a
request stream before the bad one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pdserve.kvstore.chunks import split
from pdserve.kvstore.store import KVStore
from pdserve.kvstore.wire import add_kvstore_servicer, encode
from pdserve.rpc.server import build_server
from pdserve.v1 import (
    decode_pb2_grpc,
    kvstore_pb2,
    prefill_pb2_grpc,
    router_pb2_grpc,
    scheduler_pb2_grpc,
)
from services.kvstore.servicer import KVStoreServicer

GARBAGE = [
    b"\xff\xff\xff\xff",  # a tag with a truncated varint
    b"\x0a\x05abc",  # a length past the end
    b"\x0a\x02\xff\xfe",  # field 1 (a string in every request below) with invalid UTF-8
    b"\x0f",  # wire type 7 does not exist
]
UNARY = [
    "/pdserve.v1.Router/GenerateUnary",
    "/pdserve.v1.Scheduler/Assign",
    "/pdserve.v1.Scheduler/Release",
    "/pdserve.v1.Prefill/Prefill",
    "/pdserve.v1.Decode/CachedPrefix",
    "/pdserve.v1.KVStore/Delete",
    "/pdserve.v1.KVStore/Stat",
    "/grpc.health.v1.Health/Check",
]
SERVER_STREAMS = [
    "/pdserve.v1.Router/Generate",
    "/pdserve.v1.Decode/Decode",
    "/pdserve.v1.Mixed/Generate",
    "/pdserve.v1.KVStore/Get",
]


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=60))


@asynccontextmanager
async def serving() -> AsyncIterator[grpc.aio.Channel]:
    """Every pdserve service on one server: the KV store for real, the others as their
    generated base classes (UNIMPLEMENTED once a message parses)."""
    server, port, health = build_server(
        [
            (router_pb2_grpc.add_RouterServicer_to_server, router_pb2_grpc.RouterServicer()),
            (
                scheduler_pb2_grpc.add_SchedulerServicer_to_server,
                scheduler_pb2_grpc.SchedulerServicer(),
            ),
            (prefill_pb2_grpc.add_PrefillServicer_to_server, prefill_pb2_grpc.PrefillServicer()),
            (decode_pb2_grpc.add_DecodeServicer_to_server, decode_pb2_grpc.DecodeServicer()),
            (decode_pb2_grpc.add_MixedServicer_to_server, decode_pb2_grpc.MixedServicer()),
            (add_kvstore_servicer, KVStoreServicer(KVStore(1 << 20))),
        ],
        port=0,
    )
    await server.start()
    await health.set_serving()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


def _raw(channel: grpc.aio.Channel, path: str, streaming: bool) -> Callable[[bytes], object]:
    # No serializers: the bytes go on the wire as they are.
    return (channel.unary_stream if streaming else channel.unary_unary)(path)


@pytest.mark.parametrize("raw", GARBAGE)
def test_garbage_is_invalid_argument_on_every_method(raw: bytes) -> None:
    async def body() -> None:
        async with serving() as channel:
            for path in UNARY + SERVER_STREAMS:
                call = _raw(channel, path, path in SERVER_STREAMS)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    result = call(raw)
                    if path in SERVER_STREAMS:
                        async for _ in result:  # type: ignore[attr-defined]
                            pass
                    else:
                        await result  # type: ignore[misc]
                err = info.value
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, err)
                assert (err.details() or "").startswith("request: malformed message"), path

    run(body)


def test_valid_messages_still_reach_their_handlers() -> None:
    async def body() -> None:
        async with serving() as channel:
            check = _raw(channel, "/grpc.health.v1.Health/Check", False)
            reply = health_pb2.HealthCheckResponse.FromString(await check(b""))  # type: ignore[misc]
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stat = _raw(channel, "/pdserve.v1.KVStore/Stat", False)
            answer = kvstore_pb2.StatResponse.FromString(await stat(b"\x0a\x01k"))  # type: ignore[misc]
            assert not answer.exists

    run(body)


def test_a_bad_message_in_a_request_stream_is_refused_where_it_is() -> None:
    async def body() -> None:
        async with serving() as channel:
            put = channel.stream_unary("/pdserve.v1.KVStore/Put")
            # A real first chunk of a two-chunk payload, then bytes that do not parse.
            good = encode(next(split(b"x" * 20, key="k", lease_s=5.0, chunk_bytes=10)))

            async def chunks() -> AsyncIterator[bytes]:
                yield good
                yield b"\x0a\x02\xff\xfe"

            with pytest.raises(grpc.aio.AioRpcError) as info:
                await put(chunks())
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed message" in (info.value.details() or "")
            # Nothing of the refused stream is kept.
            stat = _raw(channel, "/pdserve.v1.KVStore/Stat", False)
            answer = kvstore_pb2.StatResponse.FromString(await stat(b""))  # type: ignore[misc]
            assert answer.num_entries == 0 and answer.num_writing == 0

    run(body)
