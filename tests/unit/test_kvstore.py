"""KVStore (leases on an injected clock, byte budget, delete), the chunk format, and the client
against the real KVStore servicer on a loopback port."""

from __future__ import annotations

import asyncio
import socket
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from pdserve.errors import CapacityError, InvalidArgumentError, KVTransferError, UnknownRequestError
from pdserve.kvstore.chunks import ChunkAssembler, split, split_parts
from pdserve.kvstore.client import KVStoreClient
from pdserve.kvstore.store import KVStore
from pdserve.kvstore.wire import add_kvstore_servicer, received_as
from pdserve.rpc.server import build_server
from services.kvstore.servicer import KVStoreServicer


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- KVStore ---------------------------------------------------------------------------------
def test_put_get_delete_roundtrip() -> None:
    store = KVStore(1000)
    lease = store.put("a", b"data", 5.0, header=b"hdr")
    entry = store.get("a")
    assert (entry.header, entry.data, entry.num_bytes, lease) == (b"hdr", b"data", 7, 5.0)
    assert store.delete("a") is True
    assert store.delete("a") is False
    with pytest.raises(UnknownRequestError):
        store.get("a")
    stats = store.stats()
    assert (stats.used_bytes, stats.num_entries, stats.hits, stats.misses) == (0, 0, 1, 1)
    assert (stats.bytes_in, stats.bytes_out) == (7, 7)


def test_lease_expiry_on_injected_clock() -> None:
    clock = FakeClock()
    store = KVStore(1000, default_lease_s=10.0, clock=clock)
    store.put("short", b"x" * 10, 2.0)
    store.put("default", b"y" * 20)  # lease 0 -> the store's default
    assert store.stat("short") is not None
    clock.now += 1.5
    stat = store.stat("short")
    assert stat is not None and stat.lease_remaining_s == pytest.approx(0.5)
    clock.now += 0.5  # exactly at the end of the lease: gone
    assert store.stat("short") is None
    with pytest.raises(UnknownRequestError):
        store.get("short")
    assert store.stats().used_bytes == 20  # its bytes were reclaimed
    clock.now += 8.0
    assert store.sweep() == 1
    stats = store.stats()
    assert (stats.num_entries, stats.used_bytes, stats.expired) == (0, 0, 2)


def test_lease_is_capped_and_validated() -> None:
    store = KVStore(100, default_lease_s=5.0, max_lease_s=30.0)
    assert store.put("k", b"1", 1e9) == 30.0
    with pytest.raises(InvalidArgumentError, match="lease_s"):
        store.put("k", b"1", -1.0)
    with pytest.raises(InvalidArgumentError, match="key"):
        store.put("", b"1")


def test_byte_budget() -> None:
    clock = FakeClock()
    store = KVStore(100, clock=clock)
    store.put("a", b"a" * 60, 1.0)
    with pytest.raises(CapacityError):
        store.put("b", b"b" * 50)
    with pytest.raises(CapacityError):
        store.put("huge", b"h" * 101)
    assert store.stats().used_bytes == 60  # a refused put leaves nothing behind
    store.put("a", b"A" * 90)  # replacing a key: its old bytes count as free
    assert store.get("a").data == b"A" * 90
    store.delete("a")
    store.put("b", b"b" * 50, 1.0)
    clock.now += 1.0  # "b" expires; a put needing its room sweeps it
    store.put("c", b"c" * 80)
    assert store.stats().used_bytes == 80


def test_delete_by_version_spares_a_replaced_entry() -> None:
    store = KVStore(100)
    store.put("k", b"old")
    old = store.get("k")
    store.put("k", b"new")
    assert store.delete("k", version=old.version) is False
    assert store.get("k").data == b"new"


# -- chunk format ----------------------------------------------------------------------------
def test_chunks_roundtrip_and_checks() -> None:
    data = bytes(range(256)) * 10
    chunks = list(split(data, key="k", header=b"H", lease_s=3.0, chunk_bytes=1000))
    assert [c.seq for c in chunks] == [0, 1, 2]
    assert [c.last for c in chunks] == [False, False, True]
    assert all(c.crc32 == zlib.crc32(c.data) for c in chunks)
    asm = ChunkAssembler()
    for c in chunks:
        asm.feed(c)
    assert asm.finish() == data
    assert (asm.key, asm.header, asm.lease_s, asm.total_bytes) == ("k", b"H", 3.0, len(data) + 1)

    bad = list(split(data, chunk_bytes=1000))
    bad[1].crc32 ^= 1
    asm = ChunkAssembler()
    asm.feed(bad[0])
    with pytest.raises(KVTransferError, match="CRC"):
        asm.feed(bad[1])

    asm = ChunkAssembler()
    with pytest.raises(InvalidArgumentError, match="seq"):
        asm.feed(chunks[1])  # a gap

    asm = ChunkAssembler()
    asm.feed(chunks[0])
    with pytest.raises(KVTransferError, match="without the last"):
        asm.finish()

    empty = list(split(b""))
    assert len(empty) == 1 and empty[0].last


# -- client <-> servicer over loopback -------------------------------------------------------
@asynccontextmanager
async def serving(store: KVStore, chunk_bytes: int = 1000) -> AsyncIterator[str]:
    server, port, _ = build_server(
        [
            (
                add_kvstore_servicer,
                KVStoreServicer(store, chunk_bytes=chunk_bytes),
            )
        ],
        port=0,
    )
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=30))


def test_client_put_get_delete_stat() -> None:
    payload = bytes(range(256)) * 37  # several chunks both ways

    async def body() -> None:
        store = KVStore(100_000)
        async with serving(store) as address, KVStoreClient(address, timeout_s=5) as client:
            put = await client.put("kv/a", payload, 7.0, chunk_bytes=999)
            assert (put.num_bytes, put.num_chunks, put.lease_s) == (len(payload), 10, 7.0)
            stat = await client.stat("kv/a")
            assert (
                stat.exists and stat.num_bytes == len(payload) and 0 < stat.lease_remaining_s <= 7
            )
            assert await client.get("kv/a") == payload
            totals = await client.stat()
            assert (totals.num_entries, totals.used_bytes, totals.capacity_bytes) == (
                1, len(payload), 100_000,
            )  # fmt: skip
            assert await client.get("kv/a", delete_after_read=True) == payload
            assert (await client.stat()).num_entries == 0
            with pytest.raises(UnknownRequestError):
                await client.get("kv/a")
            await client.put("kv/b", b"x")
            assert await client.delete("kv/b") is True
            assert await client.delete("kv/b") is False
            with pytest.raises(CapacityError):
                await client.put("kv/big", b"x" * 200_000)
            assert (await client.stat()).num_entries == 0

    run(body)


def test_a_put_stream_is_read_back_in_the_messages_that_brought_it() -> None:
    """The store keeps what a writer's stream brought over gRPC as it came, and a read sends
    each data chunk on in the very message it arrived in."""
    pieces = [bytes([i]) * (900 + i) for i in range(5)]

    async def source() -> AsyncIterator[tuple[bytes, int]]:
        yield b"", 0  # as a prefill worker opens its stream: the fields, then the data
        for p in pieces:
            yield p, zlib.crc32(p)

    async def body() -> None:
        store = KVStore(100_000)
        async with serving(store) as address, KVStoreClient(address, timeout_s=5) as client:
            await client.put_stream("kv/s", source(), header=b"H")
            handle = store.open_read("kv/s")
            try:
                chunks = list(split_parts(handle.payload.parts, key="kv/s", chunk_bytes=1000))
            finally:
                handle.close()
            assert [received_as(c) for c in chunks] == [False, *[True] * len(pieces), False]
            assert await client.get("kv/s", delete_after_read=True) == b"H" + b"".join(pieces)
            assert store.stats().num_entries == 0

    run(body)


def test_client_maps_unreachable_store_to_transfer_error() -> None:
    with socket.socket() as s:  # a port that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def body() -> None:
        async with KVStoreClient(f"127.0.0.1:{port}", timeout_s=0.5) as client:
            with pytest.raises(KVTransferError):
                await client.put("k", b"data")
            with pytest.raises(KVTransferError):
                await client.get("k")

    run(body)
