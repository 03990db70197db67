"""A nixl read that follows its writer (a prefetch): each layer is READ and checked once its
writer has marked it, while the later ones are still being written; marks an earlier
hand-off left in the same blocks are never taken; a writer that discards, a cancelled read
and a deadline end the read with nothing left behind; the pool frees a hand-off its follower
finished before the commit only at the commit."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest

from pdserve.engine.kv_payload import KVPayload
from pdserve.errors import KVTransferError
from pdserve.transfer.base import TransferState
from pdserve.transfer.faults import SendFaults
from pdserve.transfer.nixl.agent import nixl_available
from pdserve.transfer.nixl.blocks import MARK_BYTES, layer_mark
from pdserve.transfer.nixl.pool import NixlPool
from pdserve.transfer.nixl.reader import NixlReader, StaticDirectory
from pdserve.transfer.nixl.receiver import NixlReceiver
from pdserve.transfer.nixl.sender import NixlSender
from tests.unit.transfer.conftest import assert_same_payload, make_layout, random_payload
from tests.unit.transfer.nixl import _child
from tests.unit.transfer.nixl.pair import nixl_leftovers, nixl_pair

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed (the pdserve[nixl] extra)"
)

LAYERS = 4


def run(coro: object) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout=60))  # type: ignore[arg-type]


class Progress:
    """The follower's count of layers read and checked, awaitable."""

    def __init__(self) -> None:
        self.checked = 0
        self._changed = asyncio.Event()

    def __call__(self, checked: int) -> None:
        self.checked = checked
        self._changed.set()

    async def reach(self, n: int) -> None:
        while self.checked < n:
            await asyncio.wait_for(self._changed.wait(), 10)
            self._changed.clear()


def follower(
    reader: NixlReader, sender: NixlSender, progress: Progress | None = None
) -> NixlReceiver:
    return NixlReceiver(
        reader, sender.planned(), expected_layout=None, follow=True, progress=progress
    )


def begun(pool: NixlPool, rid: str, payload: KVPayload, **faults: object) -> NixlSender:
    sender = NixlSender(pool, faults=SendFaults(**faults))  # type: ignore[arg-type]
    sender.begin(rid, payload.layout, payload.num_tokens)
    return sender


def read_notified(pool: NixlPool, capability: bytes) -> None:
    """Poll the pool until the reader's notification of ``capability`` has come (NIXL
    delivers it on its progress thread: there is nothing to wait on)."""
    deadline = time.monotonic() + 5
    while not pool._held[capability].read:
        assert time.monotonic() < deadline, "the reader's notification never came"
        pool.poll()
        time.sleep(0.001)


def test_each_layer_is_checked_before_the_next_one_is_written() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            payload = random_payload(make_layout(num_layers=LAYERS), 100)
            sender = begun(pool, "follow", payload)
            progress = Progress()
            receiver = follower(reader, sender, progress)
            reading = asyncio.create_task(receiver.receive(30.0))
            for i in range(LAYERS):
                assert progress.checked == i  # nothing unwritten was taken
                sender.send_layer(i, payload.keys[i], payload.values[i])
                await progress.reach(i + 1)
            got = await reading
            assert_same_payload(got, payload)
            stats = receiver.follow_stats
            assert stats is not None and stats.layers == LAYERS and stats.reads == LAYERS
            # The reader is done before the commit: its notification frees nothing under
            # the writer; the commit frees the blocks.
            read_notified(pool, sender.capability)
            assert pool.held == 1
            assert pool.allocator.num_free < pool.allocator.num_blocks
            location = await sender.commit(5.0)
            assert location.blocks == receiver.location.blocks
            assert pool.held == 0 and pool.allocator.num_free == pool.allocator.num_blocks
            await receiver.discard()  # the Decode call's: notified already, a no-op
            del got
            assert nixl_leftovers(pool, reader) == []

    run(main())


def test_marks_an_earlier_hand_off_left_in_the_blocks_are_not_taken() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            layout = make_layout(num_layers=LAYERS)
            first = random_payload(layout, 100, seed=1)
            old = begun(pool, "old", first)
            for i in range(LAYERS):
                old.send_layer(i, first.keys[i], first.values[i])
            await old.discard()  # every layer marked, then given up
            second = random_payload(layout, 100, seed=2)
            new = begun(pool, "new", second)
            assert new.blocks == old.blocks  # the same blocks, the old marks still in them
            at = new.blocks[0] * pool.block_bytes
            lead = bytes(pool.data[at : at + 4096])
            assert layer_mark(old.capability, 0) in lead
            progress = Progress()
            receiver = follower(reader, new, progress)
            reading = asyncio.create_task(receiver.receive(30.0))
            stats = None
            while stats is None or stats.polls < 3:  # polled the old marks, took none
                await asyncio.sleep(0)
                stats = receiver.follow_stats
            assert progress.checked == 0 and not reading.done()
            for i in range(LAYERS):
                new.send_layer(i, second.keys[i], second.values[i])
            got = await reading
            assert_same_payload(got, second)
            await new.commit(5.0)
            del got
            assert nixl_leftovers(pool, reader) == []

    run(main())


def test_a_read_after_the_commit_refuses_a_layer_never_written() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            payload = random_payload(make_layout(num_layers=LAYERS), 40)
            sender = begun(pool, "drop-x", payload, drop_prefix="drop-", drop_layers={2})
            for i in range(LAYERS):
                sender.send_layer(i, payload.keys[i], payload.values[i])
            loc = await sender.commit(5.0)
            receiver = NixlReceiver(reader, loc, expected_layout=None)
            with pytest.raises(KVTransferError, match=r"layer 2 .* never written"):
                await receiver.receive(5.0)
            assert nixl_leftovers(pool, reader) == []  # the failed read freed the hand-off

    run(main())


def test_a_writer_that_discards_mid_follow_ends_the_read_and_frees_everything() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            payload = random_payload(make_layout(num_layers=LAYERS), 100)
            sender = begun(pool, "gone", payload)
            progress = Progress()
            receiver = follower(reader, sender, progress)
            reading = asyncio.create_task(receiver.receive(30.0))
            sender.send_layer(0, payload.keys[0], payload.values[0])
            await progress.reach(1)
            await sender.discard()
            with pytest.raises(KVTransferError, match="gave up"):
                await reading
            assert receiver.state is TransferState.FAILED
            await receiver.discard()  # the Decode call's (or the sweep's): nothing to free
            assert reader.allocator.num_free == reader.allocator.num_blocks
            assert nixl_leftovers(pool, reader) == []

    run(main())


def test_a_cancelled_follow_leaves_the_hand_off_for_the_decode_call() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            payload = random_payload(make_layout(num_layers=LAYERS), 100)
            sender = begun(pool, "cancelled", payload)
            progress = Progress()
            reading = asyncio.create_task(follower(reader, sender, progress).receive(30.0))
            sender.send_layer(0, payload.keys[0], payload.values[0])
            await progress.reach(1)
            reading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reading
            assert reader.allocator.num_free == reader.allocator.num_blocks
            for i in range(1, LAYERS):
                sender.send_layer(i, payload.keys[i], payload.values[i])
            loc = await sender.commit(5.0)
            got = await NixlReceiver(reader, loc, expected_layout=None).receive(5.0)
            assert_same_payload(got, payload)
            del got
            assert nixl_leftovers(pool, reader) == []

    run(main())


def test_a_follow_past_its_deadline_fails_and_leaves_the_hand_off_to_its_writer() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            payload = random_payload(make_layout(num_layers=LAYERS), 100)
            sender = begun(pool, "late", payload)
            receiver = follower(reader, sender)
            with pytest.raises(KVTransferError, match=r"timed out|deadline"):
                await receiver.receive(0.05)
            assert reader.allocator.num_free == reader.allocator.num_blocks
            assert pool.held == 1  # the writer's still
            await sender.discard()
            assert nixl_leftovers(pool, reader) == []

    run(main())


def test_a_writer_killed_mid_follow_fails_the_read_and_leaves_nothing_taken() -> None:
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
            parent.send("begun")
            location = parent.recv()
            progress = Progress()
            receiver = NixlReceiver(
                reader, location, expected_layout=None, follow=True, progress=progress
            )
            reading = asyncio.create_task(receiver.receive(30.0))
            await progress.reach(1)  # the first layer, while the writer is alive
            os.kill(child.pid or 0, signal.SIGKILL)
            child.join(10)
            with pytest.raises(KVTransferError):
                await reading
            assert receiver.state is TransferState.FAILED
            total = reader.allocator.num_blocks
            assert reader.allocator.num_free + len(reader.lost) == total
            await receiver.discard()  # notifies nobody: the peer is gone

        run(main())
        reader.close()
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


def test_a_payload_of_many_layers_is_followed_in_coalesced_runs() -> None:
    async def main() -> None:
        with nixl_pair() as (pool, reader):
            payload = random_payload(make_layout(num_layers=12), 60)
            sender = begun(pool, "runs", payload)
            for i in range(5):  # marked before the reader comes: one READ
                sender.send_layer(i, payload.keys[i], payload.values[i])
            progress = Progress()
            receiver = follower(reader, sender, progress)
            reading = asyncio.create_task(receiver.receive(30.0))
            await progress.reach(5)
            assert progress.checked == 5
            for i in range(5, 12):
                sender.send_layer(i, payload.keys[i], payload.values[i])
            got = await reading
            assert_same_payload(got, payload)
            stats = receiver.follow_stats
            assert stats is not None and stats.layers == 12 and stats.reads < 12
            await sender.commit(5.0)
            del got
            assert nixl_leftovers(pool, reader) == []

    run(main())


def test_mark_bytes() -> None:
    a, b = layer_mark(b"a" * 16, 0), layer_mark(b"b" * 16, 0)
    assert len(a) == MARK_BYTES and a != b != layer_mark(b"b" * 16, 1)
    assert a != bytes(MARK_BYTES)
