"""The Mooncake Store backend of the KV store seam (``kvstore.mooncake``) against a real
``mooncake_master`` and real clients lending real segments: addresses, round trips between
clients on different loopback addresses, lookups, deletes, a read that deletes, replicas that
outlive a holder, a cut stream that leaves nothing, a master that is down, and the start-time
refusal without the package. Skipped, with the reason, where the package cannot load."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from pdserve.errors import (
    CapacityError,
    InvalidArgumentError,
    KVTransferError,
    UnknownRequestError,
)
from pdserve.kvstore.backend import StoreClient, check_address, open_store
from pdserve.kvstore.client import KVStoreClient
from pdserve.kvstore.mooncake.address import MooncakeAddress, is_mooncake, parse_size
from pdserve.kvstore.mooncake.client import MooncakeStoreClient
from pdserve.kvstore.mooncake.master import MasterProcess
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.worker.options import options_from_args, worker_parser

REPO = Path(__file__).resolve().parents[2]


def run(body: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(body, timeout=60))


def client(master: MasterProcess, host: str, **options: str | int) -> MooncakeStoreClient:
    return MooncakeStoreClient(master.address(**options), timeout_s=5, local_host=host)


# -- addresses (no master needed) --------------------------------------------------------
def test_an_address_defaults_and_options() -> None:
    a = MooncakeAddress.parse("mooncake://10.0.0.5:50051")
    assert (a.master, a.metadata) == ("10.0.0.5:50051", "http://10.0.0.5:8080/metadata")
    assert (a.replicas, a.segment_bytes, a.buffer_bytes, a.protocol) == (
        1,
        256 << 20,
        16 << 20,
        "tcp",
    )
    b = MooncakeAddress.parse(
        "mooncake://m:1?metadata=http://meta:9/metadata&replicas=2&segment=1GiB&buffer=32MiB"
    )
    assert (b.metadata, b.replicas, b.segment_bytes, b.buffer_bytes) == (
        "http://meta:9/metadata", 2, 1 << 30, 32 << 20,
    )  # fmt: skip
    assert parse_size("s", "0") == 0 and parse_size("s", "4KiB") == 4096
    assert is_mooncake("mooncake://m:1") and not is_mooncake("127.0.0.1:7000")


@pytest.mark.parametrize(
    ("address", "field"),
    [
        ("mooncake://m", "kvstore"),
        ("mooncake://m:1/path", "kvstore"),
        ("mooncake://m:1?replicas=0", "kvstore.replicas"),
        ("mooncake://m:1?segment=lots", "kvstore.segment"),
        ("mooncake://m:1?buffer=1KiB", "kvstore.buffer"),
        ("mooncake://m:1?protocol=udp", "kvstore.protocol"),
        ("mooncake://m:1?replica=2", "kvstore.replica"),
        ("mooncake://m:1?metadata=ftp://x", "kvstore.metadata"),
    ],
)
def test_a_bad_address_is_refused_naming_the_field(address: str, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        MooncakeAddress.parse(address)
    assert err.value.field == field


def test_open_store_picks_the_store_the_address_names() -> None:
    async def body() -> None:
        ours = open_store("127.0.0.1:1")
        moon = open_store("mooncake://127.0.0.1:1")
        assert isinstance(ours, KVStoreClient) and ours.follows
        assert isinstance(moon, MooncakeStoreClient) and not moon.follows
        for c in (ours, moon):
            await c.close()

    run(body())


def test_a_bad_address_in_a_handle_is_refused_naming_the_handles_field() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        open_store("mooncake://m:1?segment=much", field="kv.store.address")
    assert err.value.field == "kv.store.address.segment"
    with pytest.raises(InvalidArgumentError) as err:
        MooncakeStoreClient("mooncake://m:1", timeout_s=0)
    assert err.value.field == "timeout_s"


def test_the_worker_flag_takes_a_mooncake_address_and_refuses_a_bad_one() -> None:
    parser = worker_parser("w", None, roles=[WorkerRole.PREFILL], default_max_wait_ms=0, env={})
    args = ["--model", "/m", "--role", "prefill", "--kv-store", "mooncake://m:1?replicas=2"]
    assert options_from_args(parser.parse_args(args)).kvstore == "mooncake://m:1?replicas=2"
    with pytest.raises(InvalidArgumentError) as err:
        options_from_args(parser.parse_args([*args[:-1], "mooncake://m:1?replicas=x"]))
    assert err.value.field == "--kvstore.replicas"


def test_without_the_package_a_mooncake_store_is_refused_at_start_naming_the_extra() -> None:
    # A real interpreter in which the package cannot be imported (``None`` in sys.modules
    # makes any import of it fail), starting a real prefill worker's option check.
    code = (
        "import sys; sys.modules['mooncake'] = None\n"
        "from pdserve.kvstore.backend import check_address\n"
        "check_address('mooncake://127.0.0.1:1', '--kvstore')\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "pdserve[mooncake]" in proc.stderr and "--kvstore" in proc.stderr
    check_address("127.0.0.1:7000")  # our own store needs nothing


def test_an_object_is_put_from_its_parts_as_they_came_with_or_without_the_gather_call() -> None:
    # The writer keeps each piece (and its lead) as it came; the object is the same bytes
    # whether the library gathers the parts itself or is given them joined.
    import ctypes

    import numpy as np

    from pdserve.kvstore.mooncake.library import Library
    from pdserve.kvstore.mooncake.objects import ObjectWriter, decode_head, pieces_of

    piece = bytearray(os.urandom(1000))
    writer = ObjectWriter(b"HEAD", 1010, cache=False)
    writer.write(memoryview(piece), lead=b"LEAD")
    writer.write(b"tail56")
    parts = writer.finish("k")
    assert any(np.shares_memory(p, np.frombuffer(piece, dtype=np.uint8)) for p in parts)

    class Joined:  # a library without batch_put_from_multi_buffers
        stored = b""

        def put_from(self, key: str, ptr: int, size: int, config: object) -> int:
            self.stored = ctypes.string_at(ptr, size)
            return 0

    class Gathering(Joined):
        def batch_put_from_multi_buffers(
            self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]], config: object
        ) -> list[int]:
            self.stored = b"".join(
                ctypes.string_at(p, n) for p, n in zip(ptrs[0], sizes[0], strict=True)
            )
            return [0]

    library = Library(module=None)
    stores = [Joined(), Gathering()]
    for store in stores:
        assert library.put_parts(store, "k", parts, None) == 0
    assert stores[0].stored == stores[1].stored
    raw = memoryview(stores[1].stored)
    header, start = decode_head("k", raw)
    assert header == b"HEAD"
    assert [bytes(p) for p in pieces_of("k", raw, start)] == [b"LEAD" + piece, b"tail56"]


# -- against a real master --------------------------------------------------------------
async def pieces(parts: list[bytes], fail_after: int | None = None) -> AsyncIterator[bytes]:
    for i, part in enumerate(parts):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("the producer broke off")
        yield part


def with_clients(
    master: MasterProcess,
    body: Callable[[MooncakeStoreClient, MooncakeStoreClient], Awaitable[None]],
) -> None:
    """A writer lending a segment on 127.0.0.1 and a pure reader on 127.0.0.2."""

    async def main() -> None:
        writer = client(master, "127.0.0.1", segment="32MiB")
        reader = client(master, "127.0.0.2", segment=0)
        try:
            await body(writer, reader)
        finally:
            await reader.close()
            await writer.close()
        assert master.key_count() == 0  # every test removes what it put

    run(main())


def test_put_and_get_between_two_hosts(mooncake_master: MasterProcess) -> None:
    data = os.urandom(3 << 20)

    async def body(w: StoreClient, r: StoreClient) -> None:
        await w.put("t1/pfx/a", data, header=b"HEAD", cache=True)
        assert await r.get("t1/pfx/a") == b"HEAD" + data
        chunks = [c async for c in r.stream("t1/pfx/a")]
        assert chunks[0].header == b"HEAD" and chunks[-1].last
        assert b"".join(bytes(c.data) for c in chunks) == data
        assert await r.delete("t1/pfx/a") is True
        assert await r.delete("t1/pfx/a") is False

    with_clients(mooncake_master, body)


def test_a_streamed_put_keeps_the_writers_pieces_and_a_read_deletes(
    mooncake_master: MasterProcess,
) -> None:
    parts = [os.urandom(n) for n in (1000, 70_000, 5)]

    async def body(w: StoreClient, r: StoreClient) -> None:
        total = 3 + sum(map(len, parts))
        result = await w.put_stream("t2/kv/x", pieces(parts), header=b"HDR", total_bytes=total)
        assert result.num_bytes == total
        chunks = [c async for c in r.stream("t2/kv/x", delete_after_read=True)]
        assert [bytes(c.data) for c in chunks] == parts  # cut where the writer cut
        assert all(c.data.readonly for c in chunks)  # kept as views, never written
        with pytest.raises(UnknownRequestError):
            await r.get("t2/kv/x")

    with_clients(mooncake_master, body)


def test_a_stream_that_breaks_off_or_lies_about_its_size_leaves_nothing(
    mooncake_master: MasterProcess,
) -> None:
    async def body(w: StoreClient, r: StoreClient) -> None:
        with pytest.raises(KVTransferError, match="broke off"):
            await w.put_stream("t3/kv/a", pieces([b"x" * 100, b"y"], fail_after=1), total_bytes=101)
        with pytest.raises(KVTransferError, match="announced 500 bytes and sent 100"):
            await w.put_stream("t3/kv/b", pieces([b"x" * 100]), total_bytes=500)
        assert await r.lookup(["t3/kv/a"]) == 0 and await r.lookup(["t3/kv/b"]) == 0

    with_clients(mooncake_master, body)


def test_an_object_larger_than_every_segment_is_a_capacity_error(
    mooncake_master: MasterProcess,
) -> None:
    async def body(w: StoreClient, r: StoreClient) -> None:
        with pytest.raises(CapacityError, match="full"):
            await w.put("t8/huge", bytes(40 << 20))  # the only segment lends 32 MiB
        assert await r.lookup(["t8/huge"]) == 0

    with_clients(mooncake_master, body)


def test_lookup_counts_the_leading_keys_held(mooncake_master: MasterProcess) -> None:
    async def body(w: StoreClient, r: StoreClient) -> None:
        for k in ("t4/0", "t4/1", "t4/3"):
            await w.put(k, b"v", cache=True)
        assert await r.lookup(["t4/0", "t4/1", "t4/2", "t4/3"]) == 2
        assert await r.lookup(["t4/2", "t4/0"]) == 0
        assert await r.lookup([]) == 0
        for k in ("t4/0", "t4/1", "t4/3"):
            assert await r.delete(k)

    with_clients(mooncake_master, body)


def test_a_missing_key_is_unknown_and_a_foreign_object_is_refused(
    mooncake_master: MasterProcess,
) -> None:
    async def body(w: MooncakeStoreClient, r: MooncakeStoreClient) -> None:
        with pytest.raises(UnknownRequestError, match="t5/none"):
            await r.get("t5/none")
        # An object some other program wrote under a key: not a KV entry.
        store = await w._joined()
        assert store.put("t5/foreign", b"not ours") == 0
        with pytest.raises(KVTransferError, match="not a pdserve KV entry"):
            await r.get("t5/foreign")
        assert await r.delete("t5/foreign")

    with_clients(mooncake_master, body)


def test_two_replicas_outlive_the_client_that_wrote_them(mooncake_master: MasterProcess) -> None:
    data = os.urandom(1 << 20)

    async def body() -> None:
        holder = client(mooncake_master, "127.0.0.3", segment="16MiB")
        writer = client(mooncake_master, "127.0.0.4", segment="16MiB", replicas=2)
        reader = client(mooncake_master, "127.0.0.5", segment=0)
        try:
            await holder.lookup(["t6/warm"])  # joined: its segment is lent
            await writer.put("t6/pfx", data, cache=True)
            await writer.close()  # its segment, and one copy, go with it
            assert await reader.get("t6/pfx") == data
            assert await reader.delete("t6/pfx")
        finally:
            await reader.close()
            await holder.close()

    run(body())
    assert mooncake_master.key_count() == 0


def test_an_unreachable_master_is_a_clear_error_not_a_hang() -> None:
    async def body() -> None:
        c = MooncakeStoreClient("mooncake://127.0.0.1:1", timeout_s=2)
        try:
            with pytest.raises(KVTransferError, match=r"127\.0\.0\.1:1 is unreachable"):
                await c.lookup(["k"])
        finally:
            await c.close()

    run(body())


def test_a_master_killed_under_a_client_fails_its_calls() -> None:
    async def body() -> None:
        with MasterProcess() as master:
            c = client(master, "127.0.0.1", segment="16MiB")
            try:
                await c.put("t7/k", b"v", cache=True)
                master.kill()
                with pytest.raises(KVTransferError):
                    await c.put("t7/k2", b"v", cache=True)
                with pytest.raises(KVTransferError):
                    await c.lookup(["t7/k"])
            finally:
                await c.close()

    run(body())
