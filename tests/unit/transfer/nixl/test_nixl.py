"""The nixl transport beyond the shared contract (``test_contract.py`` runs that on it too):
what a reader refuses before it reads (metadata that does not match its fingerprint, blocks
outside the registered pool, blocks not held for the hand-off), a peer that vanishes, a
deadline, capacity, leases, and that nothing stays registered, held or taken."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import signal

import pytest

from pdserve.errors import CapacityError, InvalidArgumentError, KVTransferError
from pdserve.transfer.base import KVLocation, TransferState
from pdserve.transfer.nixl.agent import AgentDescriptor, fingerprint, nixl_available
from pdserve.transfer.nixl.blocks import BlockAllocator, cut_pieces, pair_ranges, ranges, runs
from pdserve.transfer.nixl.pool import NixlPool
from pdserve.transfer.nixl.reader import NixlReader, StaticDirectory
from pdserve.transfer.nixl.receiver import NixlReceiver
from pdserve.transfer.nixl.sender import NixlSender
from tests.unit.transfer.conftest import assert_same_payload, make_layout, random_payload
from tests.unit.transfer.nixl import _child
from tests.unit.transfer.nixl.pair import nixl_leftovers, nixl_pair

needs_nixl = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed (the pdserve[nixl] extra)"
)


def run(coro: object) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=60))  # type: ignore[arg-type]


async def committed(pool: NixlPool, rid: str, num_tokens: int = 40) -> KVLocation:
    payload = random_payload(make_layout(), num_tokens)
    sender = NixlSender(pool)
    sender.begin(rid, payload.layout, num_tokens)
    for i in range(payload.layout.num_layers):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    return await sender.commit(5.0)


# -- blocks (no NIXL needed) ---------------------------------------------------------------
def test_runs_and_ranges_coalesce_contiguous_blocks() -> None:
    assert runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert ranges([3, 4, 5, 9], 1000, 10, 35) == [(1030, 30), (1090, 5)]
    with pytest.raises(InvalidArgumentError, match="blocks"):
        ranges([1, 2], 0, 10, 21)


def test_pair_ranges_cut_both_layouts_at_every_boundary() -> None:
    local = [(0, 25), (100, 15)]
    remote = [(1000, 10), (2000, 30)]
    pairs = pair_ranges(local, remote)
    assert pairs == [((0, 10), (1000, 10)), ((10, 15), (2000, 15)), ((100, 15), (2015, 15))]
    with pytest.raises(InvalidArgumentError):
        pair_ranges([(0, 5)], [(0, 6)])


def test_pieces_cut_the_pairs_at_their_size_and_say_where_each_ends() -> None:
    pairs = [((0, 10), (1000, 10)), ((100, 25), (2000, 25))]
    pieces = cut_pieces(pairs, 12)
    assert [end for _, end in pieces] == [12, 24, 35]
    assert pieces[0][0] == [((0, 10), (1000, 10)), ((100, 2), (2000, 2))]
    assert pieces[1][0] == [((102, 12), (2002, 12))]
    assert pieces[2][0] == [((114, 11), (2014, 11))]
    assert cut_pieces(pairs, 0) == [(pairs, 35)]


def test_the_allocator_prefers_a_run_and_refuses_past_capacity() -> None:
    a = BlockAllocator(8)
    first = a.take(3)
    second = a.take(2)
    assert first == [0, 1, 2] and second == [3, 4]
    a.give_back(first)
    assert a.take(4) == [0, 1, 2, 5]  # no run of 4: the lowest free ids
    with pytest.raises(CapacityError):
        a.take(3)
    with pytest.raises(InvalidArgumentError, match="free already"):
        a.give_back([7])


def test_a_descriptor_round_trips_and_its_fingerprint_covers_every_field() -> None:
    d = AgentDescriptor("a", b"\x00meta", 4096, 8192, 16, 4096)
    assert AgentDescriptor.decode(d.encode()) == d
    assert d.fingerprint == fingerprint(d.encode())
    other = dataclasses.replace(d, data_addr=8192 + 4096)
    assert other.fingerprint != d.fingerprint
    with pytest.raises(KVTransferError, match="outside"):
        d.block_range(16)
    with pytest.raises(KVTransferError, match="unreadable"):
        AgentDescriptor.decode('{"agent": "a"}')


# -- a pool and a reader in one process ----------------------------------------------------
@needs_nixl
def test_reads_coalesced_and_scattered_blocks_and_frees_them() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            # Scatter the free blocks: a hand-off then lies in several runs.
            holes = [pool.allocator.take(1) for _ in range(6)]
            pool.free(holes[1] + holes[3])
            big = pool.allocator.take(pool.allocator.num_free - 4)  # free: 1, 3, 254, 255
            payload = random_payload(make_layout(num_layers=2), 60)  # 4 blocks of 4 KiB
            sender = NixlSender(pool)
            sender.begin("scattered", payload.layout, 60)
            assert len(runs(sender.blocks)) > 1
            for i in (1, 0):
                sender.send_layer(i, payload.keys[i], payload.values[i])
            loc = await sender.commit(5.0)
            got = await NixlReceiver(reader, loc, expected_layout=payload.layout).receive(5.0)
            assert_same_payload(got, payload)
            pool.free(big + holes[0] + holes[2] + holes[4] + holes[5])
            assert nixl_leftovers(pool, reader) == []

    run(main())


@needs_nixl
def test_a_payload_of_many_pieces_is_checked_as_they_land_and_read_back_whole() -> None:
    async def main() -> None:
        with nixl_pair(pool_bytes=32 << 20, reader_bytes=32 << 20) as (pool, reader):
            payload = random_payload(make_layout(num_layers=5), 40_000)  # 25.6 MB: 7 pieces
            sender = NixlSender(pool)
            sender.begin("big", payload.layout, 40_000)
            for i in range(5):
                sender.send_layer(i, payload.keys[i], payload.values[i])
            loc = await sender.commit(5.0)
            got = await NixlReceiver(reader, loc, expected_layout=payload.layout).receive(30.0)
            assert_same_payload(got, payload)
            del got
            # A flipped byte in the last layer's V fails the read (its CRC), not a silent KV.
            again = await committed(pool, "flip", num_tokens=40)
            bad = pool.data[again.blocks[0] * pool.block_bytes + again.length - 1 :]
            bad[0] ^= 0xFF
            with pytest.raises(KVTransferError, match=r"(?i)crc|checksum"):
                await NixlReceiver(reader, again, expected_layout=None).receive(5.0)
            assert nixl_leftovers(pool, reader) == []

    run(main())


@needs_nixl
def test_a_payload_lies_in_its_landing_blocks_until_imported_or_dropped() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            free = reader.allocator.num_free
            got = await NixlReceiver(
                reader, await committed(pool, "a"), expected_layout=None
            ).receive(5.0)
            base, end = reader.base, reader.base + reader.data.nbytes
            assert all(base <= t.ctypes.data < end for t in got.keys + got.values)  # no copy
            assert reader.lent > 0 and reader.allocator.num_free == free - reader.lent
            assert got.release is not None
            got.release()  # the engine's import
            got.release()  # once
            assert reader.lent == 0 and reader.allocator.num_free == free
            dropped = await NixlReceiver(
                reader, await committed(pool, "b"), expected_layout=None
            ).receive(5.0)
            assert reader.lent > 0
            del dropped  # never imported: its tensors going gives the blocks back
            assert reader.lent == 0 and reader.allocator.num_free == free
            assert nixl_leftovers(pool, reader) == []

    run(main())


@needs_nixl
def test_metadata_that_does_not_match_the_fingerprint_is_never_loaded() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            loc = await committed(pool, "r1")
            directory = reader.directory
            assert isinstance(directory, StaticDirectory)
            # Published metadata altered after its fingerprint was taken.
            forged = dataclasses.replace(pool.descriptor, data_addr=pool.descriptor.tags_addr)
            directory.publish(pool.name, forged.encode(), pool.fingerprint)
            receiver = NixlReceiver(reader, loc, expected_layout=None)
            with pytest.raises(KVTransferError, match="does not match the fingerprint published"):
                await receiver.receive(5.0)
            # Consistent with itself, but not what the handle names (a restarted worker).
            directory.publish(pool.name, forged.encode(), forged.fingerprint)
            with pytest.raises(KVTransferError, match="the handle names"):
                await NixlReceiver(reader, loc, expected_layout=None).receive(5.0)
            assert reader._peers == {}  # nothing was loaded
            directory.publish(pool.name, pool.published, pool.fingerprint)
            got = await NixlReceiver(reader, loc, expected_layout=None).receive(5.0)
            assert got.num_tokens == 40
            assert reader._peers[pool.name][0] == pool.fingerprint  # loaded, once
            # A later handle naming the fingerprint loaded already needs no look-up.
            directory.published.clear()
            again = await committed(pool, "r2")
            assert (await NixlReceiver(reader, again, expected_layout=None).receive(5.0)).num_tokens
            assert nixl_leftovers(pool, reader) == []

    run(main())


@needs_nixl
def test_blocks_outside_the_registered_pool_are_refused_before_any_read() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            loc = await committed(pool, "r1")
            n = pool.descriptor.num_blocks
            outside = dataclasses.replace(loc, blocks=(*loc.blocks[:-1], n))
            with pytest.raises(KVTransferError, match="outside"):
                await NixlReceiver(reader, outside, expected_layout=None).receive(5.0)
            for bad, field in [
                (dataclasses.replace(loc, blocks=loc.blocks[:-1]), "blocks"),
                (dataclasses.replace(loc, blocks=(loc.blocks[0],) * len(loc.blocks)), "twice"),
                (dataclasses.replace(loc, length=0), "length"),
            ]:
                with pytest.raises(InvalidArgumentError, match=field):
                    await NixlReceiver(reader, bad, expected_layout=None).receive(5.0)
            # NIXL itself refuses a range beyond what the peer registered.
            end = pool.descriptor.data_addr + n * pool.block_bytes
            landing = reader.take(8192)
            with pytest.raises(KVTransferError, match="failed"):
                await reader.read(pool.name, [(end - 4096, 8192)], landing, 1e18)
            reader.give_back(landing)
            # The refused receivers notified nothing that was not theirs: r1 is still held.
            assert pool.held == 1
            got = await NixlReceiver(reader, loc, expected_layout=None).receive(5.0)
            assert got.num_tokens == 40
            assert nixl_leftovers(pool, reader) == []

    run(main())


@needs_nixl
def test_blocks_not_held_for_the_hand_off_are_not_taken_for_its_kv() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            mine = await committed(pool, "mine")
            theirs = await committed(pool, "theirs")
            # My capability over their blocks, and a guessed capability over mine.
            for bad in [
                dataclasses.replace(mine, blocks=theirs.blocks),
                dataclasses.replace(mine, capability=bytes(16)),
            ]:
                receiver = NixlReceiver(reader, bad, expected_layout=None)
                with pytest.raises(KVTransferError, match="not held"):
                    await receiver.receive(5.0)
                assert receiver.state is TransferState.FAILED
            # Blocks that were freed (read already) are not held either.
            await NixlReceiver(reader, mine, expected_layout=None).receive(5.0)
            assert pool.settle(5.0) == 1
            with pytest.raises(KVTransferError, match="not held"):
                await NixlReceiver(reader, mine, expected_layout=None).receive(5.0)
            # Neither the forged nor the second read freed the other hand-off.
            got = await NixlReceiver(reader, theirs, expected_layout=None).receive(5.0)
            assert got.num_tokens == 40
            assert nixl_leftovers(pool, reader) == []

    run(main())


@needs_nixl
def test_a_full_pool_refuses_at_begin_and_a_lease_frees_an_unread_hand_off() -> None:
    async def main() -> None:
        with nixl_pair(pool_bytes=16 * 4096, lease_s=0.5) as (pool, reader):
            loc = await committed(pool, "r1")  # 3 layers of 40 tokens: 4 blocks
            layout = make_layout()
            with pytest.raises(CapacityError):
                NixlSender(pool).begin("too-big", layout, 400)
            assert pool.held == 1
            assert pool.expire(now=float("inf")) == 1  # its lease is over: freed
            with pytest.raises(KVTransferError, match="not held"):
                await NixlReceiver(reader, loc, expected_layout=None).receive(5.0)
            assert nixl_leftovers(pool, reader) == []

    run(main())


@needs_nixl
def test_a_discarded_receiver_frees_the_hand_off_unread() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            loc = await committed(pool, "r1")
            await NixlReceiver(reader, loc, expected_layout=None).discard()
            assert pool.settle(5.0) == 0
            assert nixl_leftovers(pool, reader) == []

    run(main())


@needs_nixl
def test_a_peer_that_vanishes_fails_the_read_and_leaves_nothing_taken() -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_child.serve, args=(child_end, 2000), daemon=True)
    child.start()
    try:
        name, published, fp = parent.recv()
        directory = StaticDirectory()
        directory.publish(name, published, fp)
        reader = NixlReader(directory, num_bytes=64 << 20, block_bytes=64 << 10)

        async def main() -> None:
            parent.send("hand-off")
            first = parent.recv()
            got = await NixlReceiver(reader, first, expected_layout=None).receive(10.0)
            assert got.num_tokens == 2000  # the peer is there
            parent.send("hand-off")
            second = parent.recv()
            os.kill(child.pid or 0, signal.SIGKILL)
            child.join(10)
            receiver = NixlReceiver(reader, second, expected_layout=None)
            with pytest.raises(KVTransferError):
                await receiver.receive(10.0)
            assert receiver.state is TransferState.FAILED
            # Only the first payload's landing blocks are taken (lent to it).
            assert reader.allocator.num_free + reader.lent == reader.allocator.num_blocks
            assert reader.lost == []
            await receiver.discard()  # notifies nobody: the peer is gone

        run(main())
        reader.close()
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


@needs_nixl
def test_a_peer_killed_mid_read_fails_the_read_and_the_reader_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # TCP (both processes): a 100 MB read takes long enough to kill its peer during it.
    monkeypatch.setenv("UCX_TLS", "tcp")
    ctx = multiprocessing.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_child.serve, args=(child_end, 200_000, 128 << 20), daemon=True)
    child.start()
    try:
        name, published, fp = parent.recv()
        directory = StaticDirectory()
        directory.publish(name, published, fp)
        reader = NixlReader(directory, num_bytes=128 << 20, block_bytes=64 << 10)
        total = reader.allocator.num_blocks

        async def main() -> None:
            parent.send("hand-off")
            loc = parent.recv()
            receiver = NixlReceiver(reader, loc, expected_layout=None)
            reading = asyncio.create_task(receiver.receive(60.0))
            # Its landing blocks are taken just before its READs are posted.
            while reader.allocator.num_free > total - 2 and not reading.done():
                await asyncio.sleep(0)  # the read's own polls yield here
            assert not reading.done()  # its READs are posted, not done
            os.kill(child.pid or 0, signal.SIGKILL)
            with pytest.raises(KVTransferError):
                await reading
            assert receiver.state is TransferState.FAILED
            assert reader.allocator.num_free + len(reader.lost) == total
            # The reader goes on with another peer.
            with nixl_pair() as (pool, _):
                directory.publish(pool.name, pool.published, pool.fingerprint)
                got = await NixlReceiver(
                    reader, await committed(pool, "next"), expected_layout=None
                ).receive(10.0)
                assert got.num_tokens == 40

        run(main())
        child.join(10)
        reader.close()
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


@needs_nixl
def test_a_read_past_its_deadline_fails_and_its_blocks_come_back() -> None:
    async def main() -> None:
        with nixl_pair(pool_bytes=64 << 20, reader_bytes=64 << 20) as (pool, reader):
            loc = await committed(pool, "big", num_tokens=100_000)  # 19 MB
            receiver = NixlReceiver(reader, loc, expected_layout=None)
            with pytest.raises(KVTransferError, match="deadline"):
                await receiver.receive(1e-6)
            # Its landing blocks came back, unless NIXL could not release the read (then
            # they are never handed out again); the prefill side was told to free its blocks.
            assert reader.allocator.num_free + len(reader.lost) == reader.allocator.num_blocks
            assert pool.settle(5.0) == 0
            assert pool.allocator.num_free == pool.allocator.num_blocks

    run(main())


@needs_nixl
def test_closing_deregisters_and_a_closed_pool_polls_nothing() -> None:
    pool = NixlPool(num_bytes=1 << 20, block_bytes=4096)
    pool.close()
    pool.close()  # once
    assert pool.poll() == 0


@needs_nixl
def test_agents_progress_threads_wait_between_idle_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    # NIXL's wrapper hands its bindings a config whose progress-thread delay is 0 (a thread
    # that polls without pause: a whole core per agent). The config the bindings receive when
    # a pool or a reader makes its agent is recorded here; the wrapper's own is the control.
    import importlib

    from pdserve.transfer.nixl.agent import PROGRESS_DELAY_US, make_agent, nixl_api

    api = nixl_api()
    bindings = importlib.import_module(f"{api.__name__}._bindings")
    real, config_class = bindings.nixlAgent, bindings.nixlAgentConfig
    delays: list[int] = []

    def recording(name: str, config: object) -> object:
        delays.append(int(config.pthrDelay))  # type: ignore[attr-defined]
        return real(name, config)

    monkeypatch.setattr(bindings, "nixlAgent", recording)
    api.nixl_agent("plain-agent", api.nixl_agent_config(backends=["UCX"]))
    make_agent(api, "waiting-agent")
    pool = NixlPool(num_bytes=1 << 20, block_bytes=64 << 10)
    reader = NixlReader(StaticDirectory(), num_bytes=1 << 20, block_bytes=64 << 10)
    pool.close()
    reader.close()
    assert delays == [0, PROGRESS_DELAY_US, PROGRESS_DELAY_US, PROGRESS_DELAY_US]
    assert bindings.nixlAgentConfig is config_class  # put back once the agent is made
