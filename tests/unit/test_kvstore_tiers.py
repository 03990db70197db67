"""The KV store's tiers, pins, streamed writes and prefix probes (``pdserve.kvstore.store``),
and the streaming client calls against the real servicer on a loopback port."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from pdserve.errors import CapacityError, KVTransferError, UnknownRequestError
from pdserve.kvstore.client import KVStoreClient
from pdserve.kvstore.disk import DIR_PREFIX, reclaim_dead_dirs
from pdserve.kvstore.store import KVStore, Tier
from pdserve.kvstore.wire import add_kvstore_servicer
from pdserve.rpc.server import build_server
from services.kvstore.servicer import KVStoreServicer


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def blob(tag: int, size: int) -> bytes:
    return bytes([tag % 256]) * size


def files(store: KVStore) -> list[Path]:
    disk = store._disk
    assert disk is not None
    return sorted(disk.path.iterdir())


# -- tiers -----------------------------------------------------------------------------------
def test_spill_and_reload_under_a_tiny_ram_budget(tmp_path: Path) -> None:
    """RAM holds two 40-byte entries; the rest spill, least recently used first, and every
    one reads back intact (reloading it spills another)."""
    store = KVStore(100, disk_dir=tmp_path, disk_bytes=10_000)
    for i in range(6):
        store.put(f"k{i}", blob(i, 40))
    stats = store.stats()
    assert (stats.num_entries, stats.num_disk_entries, stats.spills) == (6, 4, 4)
    assert stats.used_bytes <= 100 and stats.disk_used_bytes == 160
    assert len(files(store)) == 4
    assert [store.stat(f"k{i}").tier for i in range(6)] == [Tier.DISK] * 4 + [Tier.RAM] * 2  # type: ignore[union-attr]
    for i in range(6):  # oldest first: each read reloads one and spills the LRU one in RAM
        assert store.get(f"k{i}").data == blob(i, 40)
    stats = store.stats()
    # LRU order read oldest first: every read finds its entry spilled by the reads before it.
    assert (stats.reloads, stats.spills) == (6, 10) and stats.used_bytes <= 100
    assert stats.num_disk_entries == 4 and len(files(store)) == 4
    for i in range(6):
        assert store.delete(f"k{i}")
    stats = store.stats()
    assert (stats.num_entries, stats.used_bytes, stats.disk_used_bytes) == (0, 0, 0)
    assert files(store) == []
    store.close()
    assert not any(tmp_path.iterdir())


def test_everything_pinned_is_resource_exhausted_not_oom(tmp_path: Path) -> None:
    store = KVStore(100, disk_dir=tmp_path, disk_bytes=1000)
    store.put("a", blob(1, 60))
    reader = store.open_read("a")  # pinned: may not move
    with pytest.raises(CapacityError, match="pinned"):
        store.put("b", blob(2, 60))
    assert store.stats().num_entries == 1
    reader.close()
    store.put("b", blob(2, 60))  # now "a" may spill
    assert store.stat("a").tier is Tier.DISK  # type: ignore[union-attr]
    assert store.get("a").data == blob(1, 60)
    store.close()


def test_without_disk_only_cache_entries_give_way() -> None:
    store = KVStore(100)
    store.put("handoff", blob(1, 50))
    store.put("pfx/1", blob(2, 40), cache=True)
    store.put("pfx/2", blob(3, 40), cache=True)  # evicts pfx/1, never the hand-off
    assert store.stat("pfx/1") is None and store.stat("handoff") is not None
    with pytest.raises(CapacityError):
        store.put("handoff2", blob(4, 60))  # only a hand-off and one cache entry to give
    stats = store.stats()
    assert stats.evictions == 1 and stats.num_entries == 2  # a refused put drops nothing
    assert store.get("handoff").data == blob(1, 50)


def test_disk_full_drops_cache_entries_first(tmp_path: Path) -> None:
    store = KVStore(50, disk_dir=tmp_path, disk_bytes=50)
    store.put("pfx/1", blob(1, 30), cache=True)
    store.put("h1", blob(2, 30))  # pfx/1 spills
    store.put("h2", blob(3, 30))  # h1 spills; pfx/1 is dropped from disk to make room
    assert store.stat("pfx/1") is None
    assert store.stat("h1").tier is Tier.DISK  # type: ignore[union-attr]
    assert store.stats().evictions == 1
    with pytest.raises(CapacityError):
        store.put("h3", blob(4, 30))  # h2 cannot go anywhere: refused, nothing lost
    assert [store.get(k).data for k in ("h2", "h1")] == [blob(3, 30), blob(2, 30)]
    store.close()


def test_expiry_reaches_spilled_entries_and_the_files_go(tmp_path: Path) -> None:
    clock = FakeClock()
    store = KVStore(50, disk_dir=tmp_path, disk_bytes=1000, clock=clock)
    store.put("old", blob(1, 40), 5.0)
    store.put("new", blob(2, 40), 50.0)  # "old" spills
    assert len(files(store)) == 1
    clock.now += 5.0
    assert store.sweep() == 1
    assert files(store) == [] and store.stats().num_entries == 1
    with pytest.raises(UnknownRequestError):
        store.get("old")
    store.close()


def test_an_entry_deleted_while_read_frees_its_bytes_when_the_read_ends() -> None:
    store = KVStore(100)
    store.put("k", blob(1, 70))
    reader = store.open_read("k")
    assert store.delete("k")
    assert store.stat("k") is None
    assert store.stats().used_bytes == 70  # still being streamed
    with pytest.raises(CapacityError):
        store.put("other", blob(2, 50))
    reader.close()
    assert store.stats().used_bytes == 0
    store.put("other", blob(2, 50))


# -- streamed writes -------------------------------------------------------------------------
def test_pending_put_reserves_up_front_and_aborts_cleanly() -> None:
    store = KVStore(100)
    write = store.begin_put("k", header=b"H", total_bytes=81)
    assert store.stats().reserved_bytes == 81 and store.stats().num_writing == 1
    with pytest.raises(CapacityError):
        store.begin_put("other", total_bytes=30)  # the reservation counts
    write.append(blob(1, 40))
    assert store.stat("k") is None  # invisible until committed
    write.abort()
    stats = store.stats()
    assert (stats.used_bytes, stats.reserved_bytes, stats.num_writing) == (0, 0, 0)
    with pytest.raises(KVTransferError):
        write.append(b"x")


def test_pending_put_commit_checks_size_and_replaces() -> None:
    store = KVStore(1000)
    store.put("k", b"old")
    write = store.begin_put("k", header=b"HH", total_bytes=12)
    write.append(b"12345")
    with pytest.raises(KVTransferError, match="announced"):
        write.commit()
    write = store.begin_put("k", header=b"HH", total_bytes=12)
    write.append(b"12345")
    write.append(b"67890")
    write.commit()
    entry = store.get("k")
    assert (entry.header, entry.data) == (b"HH", b"1234567890")
    stats = store.stats()
    assert (stats.used_bytes, stats.num_entries, stats.num_writing) == (12, 1, 0)


def test_a_stalled_write_is_aborted_after_its_lease() -> None:
    clock = FakeClock()
    store = KVStore(1000, clock=clock)
    write = store.begin_put("k", lease_s=10.0, total_bytes=20)
    clock.now += 8.0
    write.append(blob(1, 10))  # progress moves the deadline
    clock.now += 8.0
    store.sweep()
    assert write.open
    clock.now += 3.0
    store.sweep()
    assert not write.open and store.stats().used_bytes == 0
    with pytest.raises(KVTransferError, match="lease ran out"):
        write.append(blob(1, 10))


def test_lookup_counts_leading_keys() -> None:
    store = KVStore(1000)
    for k in ("a", "b", "d"):
        store.put(k, b"x", cache=True)
    assert store.lookup(["a", "b", "c", "d"]) == 2
    assert store.lookup(["c", "a"]) == 0
    assert store.lookup([]) == 0
    stats = store.stats()
    assert (stats.lookups, stats.lookup_hits) == (6, 2)


def test_hit_rate_and_byte_counters() -> None:
    store = KVStore(1000)
    store.put("a", blob(1, 100))
    store.get("a")
    with pytest.raises(UnknownRequestError):
        store.get("b")
    stats = store.stats()
    assert stats.hit_rate == 0.5
    assert (stats.bytes_in, stats.bytes_out) == (100, 100)


def test_spill_dirs_of_dead_stores_are_reclaimed(tmp_path: Path) -> None:
    dead = tmp_path / f"{DIR_PREFIX}999999999"
    dead.mkdir()
    (dead / "x").write_bytes(b"orphan")
    alive = tmp_path / f"{DIR_PREFIX}{os.getppid()}"
    alive.mkdir()
    other = tmp_path / "unrelated"
    other.mkdir()
    assert reclaim_dead_dirs(tmp_path) == [dead]
    assert alive.exists() and other.exists() and not dead.exists()


# -- client <-> servicer ---------------------------------------------------------------------
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


def test_streamed_put_lands_piece_by_piece_and_streams_back() -> None:
    """The store holds the write (reserved, invisible) while pieces still come; a reader
    then streams it back chunk by chunk and deletes it after the last one."""
    pieces = [blob(i, 1500) for i in range(4)]

    async def body() -> None:
        store = KVStore(100_000)
        gate = asyncio.Event()

        async def source() -> AsyncIterator[bytes]:
            yield pieces[0]
            await gate.wait()
            for p in pieces[1:]:
                yield p

        async with serving(store) as address, KVStoreClient(address, timeout_s=5) as client:
            total = 3 + sum(map(len, pieces))
            put = asyncio.create_task(
                client.put_stream("k", source(), header=b"HDR", total_bytes=total)
            )
            while store.stats().num_writing == 0:  # bounded by the test timeout
                await asyncio.sleep(0.01)
            stats = await client.stat()
            assert stats.totals is not None and stats.totals.reserved_bytes == total
            assert not (await client.stat("k")).exists
            gate.set()
            result = await put
            assert result.num_bytes == total
            got = [c async for c in client.stream("k", delete_after_read=True)]
            assert got[0].header == b"HDR"
            assert b"".join(c.data for c in got) == b"".join(pieces)
            assert len(got) > 1
            totals = (await client.stat()).totals
            assert totals is not None and (totals.num_entries, totals.used_bytes) == (0, 0)

    run(body)


def test_a_put_stream_that_breaks_off_leaves_nothing() -> None:
    async def body() -> None:
        store = KVStore(100_000)

        async def source() -> AsyncIterator[bytes]:
            yield blob(1, 500)
            raise KVTransferError("the producer died")

        async with serving(store) as address, KVStoreClient(address, timeout_s=5) as client:
            with pytest.raises(KVTransferError):
                await client.put_stream("k", source(), total_bytes=1000)
            for _ in range(200):  # the server notices the cancelled stream a moment later
                if store.stats().num_writing == 0:
                    break
                await asyncio.sleep(0.01)
            stats = store.stats()
            assert (stats.num_writing, stats.used_bytes, stats.num_entries) == (0, 0, 0)

    run(body)


def test_client_lookup_refusal_and_spill_stats(tmp_path: Path) -> None:
    async def body() -> None:
        store = KVStore(3000, disk_dir=tmp_path, disk_bytes=100_000)
        async with serving(store) as address, KVStoreClient(address, timeout_s=5) as client:
            for i in range(5):
                await client.put(f"pfx/{i}", blob(i, 1000), cache=True)
            assert await client.lookup([f"pfx/{i}" for i in (0, 1, 2, 9, 3)]) == 3
            assert await client.get("pfx/0") == blob(0, 1000)  # reloaded from disk
            key = await client.stat("pfx/0")
            assert key.tier == "ram"
            totals = (await client.stat()).totals
            assert totals is not None and totals.spills >= 2 and totals.reloads == 1
            with pytest.raises(CapacityError):
                await client.put_stream("big", _one(blob(1, 10)), total_bytes=5000)

    run(body)
    assert not any(tmp_path.iterdir()) or all(
        p.name.startswith(DIR_PREFIX) for p in tmp_path.iterdir()
    )


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


def test_prometheus_collector_reads_the_stats(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from pdserve.kvstore.metrics import StoreCollector

    store = KVStore(100, disk_dir=tmp_path, disk_bytes=1000)
    store.put("kv/a", blob(1, 60))
    store.put("pfx/b", blob(2, 60), cache=True)  # "kv/a" spills
    store.get("kv/a")  # reloads it, spilling "pfx/b"
    with pytest.raises(UnknownRequestError):
        store.get("nope")
    registry = CollectorRegistry()
    collector = StoreCollector()
    registry.register(collector)
    assert registry.get_sample_value("pdserve_kvstore_bytes", {"tier": "ram"}) is None
    collector.publish(store.stats())

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("pdserve_kvstore_bytes", tier="ram") == 60
    assert value("pdserve_kvstore_bytes", tier="disk") == 60
    assert value("pdserve_kvstore_entries", kind="handoff") == 1
    assert value("pdserve_kvstore_entries", kind="cache") == 1
    assert value("pdserve_kvstore_entries", kind="on_disk") == 1
    assert value("pdserve_kvstore_hit_ratio") == 0.5
    assert value("pdserve_kvstore_transfer_bytes_total", direction="in") == 120
    assert value("pdserve_kvstore_events_total", event="spill") == 2
    assert value("pdserve_kvstore_events_total", event="reload") == 1
    store.close()


def test_a_follow_read_streams_a_write_as_it_lands() -> None:
    """The reader asks before the writer has begun; it gets the first piece while the writer
    still holds back the rest (the writer waits for exactly that), then the whole entry,
    which it deletes after the last chunk."""
    pieces = [blob(i, 1500) for i in range(4)]

    async def body() -> None:
        store = KVStore(100_000)
        first_seen = asyncio.Event()

        async def source() -> AsyncIterator[bytes]:
            yield pieces[0]
            await first_seen.wait()  # only a follow-read can get it here
            for p in pieces[1:]:
                yield p

        async with serving(store) as address, KVStoreClient(address, timeout_s=10) as client:

            async def read() -> list[bytes]:
                got = []
                async for chunk in client.stream("k", delete_after_read=True, follow=True):
                    got.append(bytes(chunk.data))
                    if b"".join(got) == pieces[0]:
                        first_seen.set()
                return got

            reading = asyncio.create_task(read())
            total = 3 + sum(map(len, pieces))
            await client.put_stream("k", source(), header=b"HDR", total_bytes=total)
            got = await reading
            assert b"".join(got) == b"".join(pieces)
            totals = (await client.stat()).totals
            assert totals is not None and (totals.num_entries, totals.used_bytes) == (0, 0)

    run(body)


def test_a_follow_read_of_a_write_that_breaks_off_fails() -> None:
    async def body() -> None:
        store = KVStore(100_000)
        first_seen = asyncio.Event()

        async def source() -> AsyncIterator[bytes]:
            yield blob(1, 500)
            await first_seen.wait()
            raise KVTransferError("the producer died")

        async with serving(store) as address, KVStoreClient(address, timeout_s=10) as client:

            async def read() -> None:
                async for _ in client.stream("k", follow=True):
                    first_seen.set()

            reading = asyncio.create_task(read())
            with pytest.raises(KVTransferError):
                await client.put_stream("k", source(), total_bytes=1000)
            with pytest.raises(KVTransferError, match="broke off"):
                await reading

    run(body)
