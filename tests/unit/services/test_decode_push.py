"""``Decode.Push`` and ``Decode.Drop`` over a real server built by ``build_server`` (the error
interceptor included): a pushed hand-off lands in the worker's inbox through the chunk codec;
a malformed stream is INVALID_ARGUMENT naming the field, a bad frame reaches the sender with
its reason, a full inbox is RESOURCE_EXHAUSTED; nothing is ever left behind."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from types import SimpleNamespace

import grpc
import pytest

from pdserve.errors import CapacityError, KVTransferError
from pdserve.kvstore import wire
from pdserve.kvstore.chunks import ChunkSequence
from pdserve.kvstore.client import PutResult
from pdserve.kvstore.keys import handoff_key
from pdserve.rpc.server import build_server
from pdserve.transfer.compress import Compression
from pdserve.transfer.stream.frames import LayerCopy, stream_bytes
from pdserve.transfer.stream.header import StreamHeader
from pdserve.transfer.stream.inbox import Inbox
from pdserve.transfer.stream.push import PUSH_METHOD, PushClient
from pdserve.v1 import decode_pb2, decode_pb2_grpc, kvstore_pb2
from services.decode.servicer import DecodeServicer, add_decode_servicer
from tests.unit.transfer.conftest import make_layout, random_payload

LAYOUT = make_layout(num_layers=3)
N = 11
CALL_S = 20
"""Deadline of each call: a hang guard only, generous so a loaded machine cannot turn a
validation error into DEADLINE_EXCEEDED."""


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=3 * CALL_S))


@asynccontextmanager
async def serving(inbox: Inbox | None) -> AsyncIterator[str]:
    """A Decode servicer whose worker's connector has ``inbox`` (Push and Drop use nothing
    else of it)."""
    worker = SimpleNamespace(connector=SimpleNamespace(inbox=inbox))
    servicer = DecodeServicer(worker)  # type: ignore[arg-type]
    server, port, _ = build_server([(add_decode_servicer, servicer)], port=0)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def pieces(*, corrupt: bool = False) -> list[tuple[bytes, int] | tuple[bytes, int, bytes]]:
    payload = random_payload(LAYOUT, N)
    out: list[tuple[bytes, int] | tuple[bytes, int, bytes]] = []
    for i in range(LAYOUT.num_layers):
        copy = LayerCopy.take(i, payload.keys[i], payload.values[i])
        out += copy.seal(128, Compression.NONE, corrupt=corrupt and i == 1)
    return out


async def push(client: PushClient, key: str, rid: str = "r", **kw: bool) -> PutResult:
    async def gen() -> AsyncIterator[tuple[bytes, int] | tuple[bytes, int, bytes]]:
        for piece in pieces(**kw):
            yield piece

    header = StreamHeader(rid, LAYOUT, N)
    return await client.put_stream(
        key, gen(), header=header.encode(), total_bytes=stream_bytes(header), lease_s=30
    )


def test_a_push_lands_in_the_inbox_and_drop_frees_it() -> None:
    async def body() -> None:
        inbox = Inbox(1 << 20, expected_layout=LAYOUT)
        async with serving(inbox) as address, PushClient(address, timeout_s=CALL_S) as client:
            key = handoff_key("r", secrets.token_bytes(16))
            result = await push(client, key)
            size = stream_bytes(StreamHeader("r", LAYOUT, N))
            assert (result.num_bytes, result.lease_s) == (size, 30)
            stats = inbox.stats()
            assert (stats.num_entries, stats.num_writing, stats.used_bytes) == (1, 0, size)
            assert inbox.take(key).payload.num_tokens == N
            await push(client, key)
            assert await client.delete(key) is True
            assert await client.delete(key) is False
            assert inbox.stats().used_bytes == 0

    run(body)


def test_a_bad_frame_reaches_the_sender_with_its_reason() -> None:
    async def body() -> None:
        inbox = Inbox(1 << 20, expected_layout=LAYOUT)
        async with serving(inbox) as address, PushClient(address, timeout_s=CALL_S) as client:
            with pytest.raises(KVTransferError, match="checksum"):
                await push(client, handoff_key("r", secrets.token_bytes(16)), corrupt=True)
            assert inbox.stats().used_bytes == inbox.stats().num_writing == 0

    run(body)


def test_a_full_inbox_refuses_the_push() -> None:
    async def body() -> None:
        inbox = Inbox(stream_bytes(StreamHeader("r", LAYOUT, N)) - 1, expected_layout=LAYOUT)
        async with serving(inbox) as address, PushClient(address, timeout_s=CALL_S) as client:
            with pytest.raises(CapacityError, match="inbox full"):
                await push(client, handoff_key("r", secrets.token_bytes(16)))
            assert inbox.stats().used_bytes == 0

    run(body)


async def raw_push(address: str, chunks: list[wire.Chunk]) -> grpc.aio.AioRpcError:
    """Push ``chunks`` as they are; the call's error (the test expects one)."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = wire.chunk_stream_call(channel, PUSH_METHOD)

        async def gen() -> AsyncIterator[wire.Chunk]:
            for chunk in chunks:
                yield chunk

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(gen(), timeout=CALL_S)
        return err.value


@pytest.mark.parametrize(
    ("key", "header", "code", "field"),
    [
        ("", "good", grpc.StatusCode.INVALID_ARGUMENT, "key"),
        ("blk/fp/16/00", "good", grpc.StatusCode.INVALID_ARGUMENT, "key"),
        ("kv/r/not-a-capability", "good", grpc.StatusCode.INVALID_ARGUMENT, "key"),
        ("good", "", grpc.StatusCode.INVALID_ARGUMENT, "header"),
        ("good", "garbled", grpc.StatusCode.INVALID_ARGUMENT, "header"),
        ("good", "another request", grpc.StatusCode.INVALID_ARGUMENT, "header.request_id"),
    ],
)
def test_a_malformed_push_is_invalid_argument_naming_the_field(
    key: str, header: str, code: grpc.StatusCode, field: str
) -> None:
    good = StreamHeader("r", LAYOUT, N)
    headers = {
        "good": good.encode(),
        "": b"",
        "garbled": b"PDKVS1\n{",
        "another request": StreamHeader("q", LAYOUT, N).encode(),
    }
    if key == "good":
        key = handoff_key("r", secrets.token_bytes(16))
    sequence = ChunkSequence(key, headers[header], 30, stream_bytes(good))
    chunks = [sequence.chunk(b"", 0), *(sequence.chunk(*p) for p in pieces()), sequence.end()]

    async def body() -> None:
        inbox = Inbox(1 << 20, expected_layout=LAYOUT)
        async with serving(inbox) as address:
            err = await raw_push(address, chunks)
            assert err.code() is code
            assert (err.details() or "").startswith(f"{field}:")
        stats = inbox.stats()
        assert (stats.num_entries, stats.num_writing, stats.used_bytes) == (0, 0, 0)

    run(body)


def test_drop_needs_a_key_and_a_worker_without_an_inbox_takes_no_push() -> None:
    async def body() -> None:
        async with (
            serving(Inbox(1 << 20)) as address,
            grpc.aio.insecure_channel(address) as channel,
        ):
            stub = decode_pb2_grpc.DecodeStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Drop(kvstore_pb2.DeleteRequest(key=""), timeout=CALL_S)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith("key:")
            # The other methods are registered as generated: Prefetch reaches its handler.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefetch(decode_pb2.PrefetchRequest(), timeout=CALL_S)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith("kv:")
        async with serving(None) as address, PushClient(address, timeout_s=CALL_S) as client:
            with pytest.raises(KVTransferError, match="UNAVAILABLE"):
                await push(client, handoff_key("r", secrets.token_bytes(16)))

    run(body)
