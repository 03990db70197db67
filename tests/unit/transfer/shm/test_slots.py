"""Reused shm segments (``transfer.slots``): one file for many hand-offs, each claimed once,
and taken back on every path: released after import, revoked, expired, its reader killed."""

from __future__ import annotations

import asyncio
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.engine.kv_payload import KVPayload
from pdserve.errors import KVTransferError
from pdserve.transfer.base import KVLocation
from pdserve.transfer.janitor import (
    SHM_DIR,
    SegmentState,
    holds_hand_off,
    is_slot,
    reclaim_orphans,
    segment_state,
)
from pdserve.transfer.shm import segment
from pdserve.transfer.shm.reader import SegmentReader
from pdserve.transfer.shm.slot_mappings import SlotMappings, SlotNotReservedError
from pdserve.transfer.shm.slots import SlotPool, slot_capacity
from pdserve.transfer.shm.writer import SegmentWriter
from tests.unit.transfer.conftest import (
    assert_same_payload,
    leftovers,
    make_layout,
    random_payload,
)

LAYOUT = make_layout(num_layers=3)


@pytest.fixture
def pool(shm_prefix: str) -> Iterator[SlotPool]:
    slots = SlotPool(64 << 20, lease_s=30.0, prefix=shm_prefix)
    yield slots
    slots.close()


@pytest.fixture
def maps() -> Iterator[SlotMappings]:
    m = SlotMappings()
    yield m
    m.close()


def send(
    pool: SlotPool, rid: str, num_tokens: int = 6, seed: int = 0, *, finish: bool = True
) -> tuple[SegmentWriter, KVLocation | None, KVPayload]:
    payload = random_payload(LAYOUT, num_tokens, seed)
    sender = SegmentWriter(prefix=pool.prefix, slots=pool)
    sender.begin(rid, LAYOUT, num_tokens)
    for i in range(LAYOUT.num_layers):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    return sender, sender.finish() if finish else None, payload


def receive(maps: SlotMappings, d: KVLocation, *, follow: bool = False) -> KVPayload:
    rx = SegmentReader(expected_layout=LAYOUT, slots=maps, follow=follow, inline_bytes=0)
    return asyncio.run(rx.receive(d, 10.0))


def state(pool: SlotPool) -> SegmentState | None:
    (slot,) = pool.slots
    return segment_state(slot.path)


def test_one_slot_carries_hand_off_after_hand_off(
    pool: SlotPool, maps: SlotMappings, shm_prefix: str
) -> None:
    names, generations = set(), []
    for seed in range(4):
        _, d, sent = send(pool, f"r{seed}", seed=seed)
        assert d is not None
        got = receive(maps, d)
        assert_same_payload(got, sent)
        assert state(pool) is SegmentState.CLAIMED  # until the engine imported it
        assert got.release is not None
        got.release()
        assert state(pool) is SegmentState.FREE
        names.add(d.key)
        generations.append(d.generation)
    assert len(names) == 1 and leftovers(shm_prefix) == sorted(names)
    assert generations == sorted(set(generations)) and generations[0] > 0
    assert maps.num_mappings == 1  # the reader kept its mapping too


def test_the_views_going_release_the_slot(pool: SlotPool, maps: SlotMappings) -> None:
    _, d, _ = send(pool, "r")
    assert d is not None
    got = receive(maps, d)
    assert state(pool) is SegmentState.CLAIMED
    del got  # never imported (an abort): the last view's end lets the slot go
    assert state(pool) is SegmentState.FREE
    _, d2, _ = send(pool, "r2")
    assert d2 is not None and d2.key == d.key


def test_a_claimed_slot_is_never_written_again(pool: SlotPool, maps: SlotMappings) -> None:
    _, d, sent = send(pool, "r")
    assert d is not None
    got = receive(maps, d)
    _, d2, sent2 = send(pool, "r2", seed=1)  # the first is still held: another slot
    assert d2 is not None and d2.key != d.key and len(pool.slots) == 2
    assert_same_payload(got, sent)
    assert_same_payload(receive(maps, d2), sent2)


def test_a_hand_off_is_claimed_once(pool: SlotPool, maps: SlotMappings) -> None:
    _, d, _ = send(pool, "r")
    assert d is not None
    got = receive(maps, d)
    with pytest.raises(KVTransferError, match="already claimed"):
        receive(maps, d)
    got.release()
    with pytest.raises(KVTransferError, match="read already"):
        receive(maps, d)  # released: its data may be another hand-off's by now


def test_a_stale_generation_is_refused(pool: SlotPool, maps: SlotMappings) -> None:
    _, d, _ = send(pool, "r")
    assert d is not None
    receive(maps, d).release()
    _, d2, _ = send(pool, "r2", seed=1)
    assert d2 is not None and d2.key == d.key
    with pytest.raises(KVTransferError, match="another hand-off"):
        receive(maps, d)
    receive(maps, d2).release()


def test_revoked_after_sealing(pool: SlotPool, maps: SlotMappings) -> None:
    sender, d, _ = send(pool, "r")
    assert d is not None
    sender.abort()
    with pytest.raises(KVTransferError, match="gave the hand-off up"):
        receive(maps, d)
    _, d2, sent2 = send(pool, "r2", seed=1)  # the aborted slot serves the next one
    assert d2 is not None and d2.key == d.key
    assert_same_payload(receive(maps, d2), sent2)


def test_an_unsealed_slot_is_not_claimed(pool: SlotPool, maps: SlotMappings) -> None:
    payload = random_payload(LAYOUT, 6)
    sender = SegmentWriter(prefix=pool.prefix, slots=pool)
    sender.stalled = True  # its last layer does not seal it
    sender.begin("r", LAYOUT, 6)
    for i in range(LAYOUT.num_layers):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    with pytest.raises(KVTransferError, match="not sealed"):
        receive(maps, sender.planned())
    sender.abort()
    assert state(pool) is SegmentState.ABORTED


def test_a_sealed_slot_nobody_claims_expires(shm_prefix: str, maps: SlotMappings) -> None:
    pool = SlotPool(64 << 20, lease_s=0.001, prefix=shm_prefix)
    try:
        _, d, _ = send(pool, "r")
        assert d is not None
        time.sleep(0.01)  # past the lease; nothing else to wait on
        _, d2, sent2 = send(pool, "r2", seed=1)
        assert d2 is not None and d2.key == d.key
        with pytest.raises(KVTransferError, match="another hand-off"):
            receive(maps, d)
        assert_same_payload(receive(maps, d2), sent2)
    finally:
        pool.close()


READER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from pdserve.transfer.shm.slot_mappings import SlotMappings
    claim = SlotMappings().claim(
        Path(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3]), time.monotonic() + 10
    )
    print("claimed", flush=True)
    time.sleep(60)  # killed here, holding the claim
    """
)


def test_a_killed_reader_gives_the_slot_back(pool: SlotPool, maps: SlotMappings) -> None:
    _, d, _ = send(pool, "r")
    assert d is not None
    path = SHM_DIR / d.key
    proc = subprocess.Popen(
        [sys.executable, "-c", READER, str(path), str(d.generation), d.capability.hex()],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[4],
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
        assert segment_state(path) is SegmentState.CLAIMED
        _, d2, _ = send(pool, "r2", seed=1)  # held by a live reader: another slot
        assert d2 is not None and d2.key != d.key
        receive(maps, d2).release()
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    # Its lock went with it: the slot is taken back, CLAIMED as it was left.
    assert segment_state(path) is SegmentState.CLAIMED
    _, d3, sent3 = send(pool, "r3", seed=2)
    assert d3 is not None and d3.key in (d.key, d2.key)
    assert_same_payload(receive(maps, d3), sent3)


def follow_a_hand_off(pool: SlotPool, maps: SlotMappings, seed: int) -> None:
    """A follower started as the hand-off begins ends with exactly the payload written, and
    the slot is free once the payload is released."""
    payload = random_payload(LAYOUT, 6, seed=seed)
    sender = SegmentWriter(prefix=pool.prefix, slots=pool)
    sender.begin("r", LAYOUT, 6)
    d = sender.planned()
    rx = SegmentReader(expected_layout=LAYOUT, slots=maps, follow=True)

    async def body() -> KVPayload:
        task = asyncio.create_task(rx.receive(d, 10.0))
        for i in range(LAYOUT.num_layers):  # the first layer waits for a new slot's mapper
            await asyncio.to_thread(sender.send_layer, i, payload.keys[i], payload.values[i])
        sender.finish()
        return await task

    got = asyncio.run(body())
    assert_same_payload(got, payload)
    got.release()
    assert segment_state(SHM_DIR / d.key) is SegmentState.FREE


def test_a_follower_reads_the_slot_as_it_is_written(pool: SlotPool, maps: SlotMappings) -> None:
    receive(maps, send(pool, "warm")[1]).release()  # type: ignore[arg-type]
    follow_a_hand_off(pool, maps, seed=3)  # the warm slot, mapped on both sides


def test_the_pool_keeps_to_its_budget(shm_prefix: str) -> None:
    size = segment.SegmentGeometry.of(200, LAYOUT, 6).total
    pool = SlotPool(slot_capacity(size), prefix=shm_prefix)
    try:
        _, d, _ = send(pool, "r")
        assert d is not None and d.generation > 0
        _, d2, _ = send(pool, "r2", seed=1)  # the slot is the first's: a one-off segment
        assert d2 is not None and d2.generation == 0 and d2.key != d.key
        assert pool.num_bytes <= pool.budget_bytes
    finally:
        pool.close()
    assert not any(n.endswith("-s0") for n in leftovers(shm_prefix))


def test_closing_and_the_janitor_leave_nothing(shm_prefix: str, maps: SlotMappings) -> None:
    pool = SlotPool(64 << 20, prefix=shm_prefix)
    _, d, _ = send(pool, "r")
    assert d is not None
    # A live owner's slot stays, however long it sat sealed (its writer expires it).
    assert reclaim_orphans(shm_prefix, max_age_s=60, now=time.time() + 3600) == []
    receive(maps, d).release()
    pool.close()
    assert leftovers(shm_prefix) == []
    assert maps.num_mappings == 1  # the reader's mapping keeps the unlinked slot's memory ...
    maps.sweep()
    assert maps.num_mappings == 0  # ... until its periodic sweep
    with pytest.raises(KVTransferError, match="gone"):
        maps.claim(SHM_DIR / d.key, d.generation, d.capability, time.monotonic() + 1)


def test_capacity_rounds_up_by_at_most_an_eighth() -> None:
    for size in (1, 4096, 50_332_224, 1_610_612_736, (1 << 20) + 1):
        cap = slot_capacity(size)
        assert size <= cap <= max(4096, size * 9 // 8 + 1)


def test_two_lanes_write_a_slot(pool: SlotPool, maps: SlotMappings) -> None:
    with ThreadPoolExecutor(1) as lanes:
        payload = random_payload(LAYOUT, 40, seed=5)
        sender = SegmentWriter(prefix=pool.prefix, slots=pool, pool=lanes)
        sender.begin("r", LAYOUT, 40)
        for i in range(LAYOUT.num_layers):
            sender.send_layer(i, payload.keys[i], payload.values[i])
        d = sender.finish()
        rx = SegmentReader(expected_layout=LAYOUT, slots=maps, pool=lanes, inline_bytes=0)
        got = asyncio.run(rx.receive(d, 10.0))
    assert_same_payload(got, payload)
    got.release()
    assert os.path.exists(SHM_DIR / d.key)  # the writer's, for the next hand-off


def test_what_a_leak_check_counts(pool: SlotPool, maps: SlotMappings, shm_prefix: str) -> None:
    _, d, _ = send(pool, "r")
    assert d is not None
    path = SHM_DIR / d.key
    assert is_slot(d.key, shm_prefix) and not is_slot(f"{shm_prefix}1-abc", shm_prefix)
    assert holds_hand_off(path, shm_prefix)  # sealed, not read
    got = receive(maps, d)
    assert holds_hand_off(path, shm_prefix)  # claimed, not imported
    got.release()
    assert not holds_hand_off(path, shm_prefix)  # free: the writer's, between hand-offs
    one_off = SegmentWriter(prefix=shm_prefix)
    one_off.begin("x", LAYOUT, 2)
    assert holds_hand_off(SHM_DIR / one_off.name, shm_prefix)
    one_off.abort()
    assert not holds_hand_off(SHM_DIR / one_off.name, shm_prefix)


def test_a_hand_off_given_up_unread_is_freed(pool: SlotPool, maps: SlotMappings) -> None:
    _, d, _ = send(pool, "r")
    assert d is not None
    path = SHM_DIR / d.key
    assert not maps.discard(path, d.generation + 1, d.capability)  # not this hand-off
    assert state(pool) is SegmentState.SEALED
    assert maps.discard(path, d.generation, d.capability)
    assert state(pool) is SegmentState.FREE
    with pytest.raises(KVTransferError, match="read already"):
        receive(maps, d)
    _, d2, _ = send(pool, "r2", seed=1)
    assert d2 is not None and d2.key == d.key
    got = receive(maps, d2)
    assert not maps.discard(path, d2.generation, d2.capability)  # claimed: release frees it
    assert state(pool) is SegmentState.CLAIMED
    got.release()


@pytest.mark.parametrize("follow", [False, True], ids=["sealed", "follow"])
def test_a_corrupt_hand_off_frees_its_slot(
    pool: SlotPool, maps: SlotMappings, follow: bool
) -> None:
    payload = random_payload(LAYOUT, 6)
    sender = SegmentWriter(prefix=pool.prefix, slots=pool)

    def flip(dst: np.ndarray) -> None:
        dst[0] ^= 0xFF

    sender.tamper = flip  # layer 0 changes after it was hashed
    sender.begin("r", LAYOUT, 6)
    for i in range(LAYOUT.num_layers):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    d = sender.finish()
    rx = SegmentReader(slots=maps, follow=follow, inline_bytes=0)
    with pytest.raises(KVTransferError, match="checksum"):
        asyncio.run(rx.receive(d, 5.0))
    rx.cleanup()  # the decode worker falls back to recompute and lets the hand-off go
    assert state(pool) is SegmentState.FREE


def test_a_follower_waits_for_a_new_slot_to_be_reserved(
    pool: SlotPool, maps: SlotMappings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer's mapper reserves a new slot only once the follower found it empty.
    found_empty = threading.Event()
    mapping, reserve = maps.mapping, segment.map_for_writing

    def watched(path: Path, generation: int, capability: bytes) -> mmap.mmap:
        try:
            return mapping(path, generation, capability)
        except SlotNotReservedError:
            found_empty.set()
            raise

    def held_back(*args: Any, **kwargs: Any) -> mmap.mmap:
        assert found_empty.wait(10)
        return reserve(*args, **kwargs)

    monkeypatch.setattr(maps, "mapping", watched)
    monkeypatch.setattr(segment, "map_for_writing", held_back)
    follow_a_hand_off(pool, maps, seed=4)
    assert found_empty.is_set()


def test_a_hand_off_never_read_is_freed_once_its_lease_passes(
    pool: SlotPool, maps: SlotMappings
) -> None:
    _, d, _ = send(pool, "orphan")
    assert d is not None
    assert pool.expire() == 0  # within the lease: still its reader's
    assert state(pool) is SegmentState.SEALED
    (slot,) = pool.slots
    slot.sealed_at -= pool.lease_s + 1  # as if the lease had passed, its reader dead
    assert pool.expire() == 1
    assert state(pool) is SegmentState.FREE
    with pytest.raises(KVTransferError):
        receive(maps, d)  # the hand-off is gone, not half-readable


def test_a_claimed_slot_is_not_expired(pool: SlotPool, maps: SlotMappings) -> None:
    _, d, _ = send(pool, "slow-reader")
    assert d is not None
    got = receive(maps, d)  # claimed: its reader holds the lock until the release
    (slot,) = pool.slots
    slot.sealed_at -= pool.lease_s + 1
    assert pool.expire() == 0
    assert state(pool) is SegmentState.CLAIMED
    assert got.release is not None
    got.release()


def test_a_slot_being_claimed_is_not_unmapped_by_another_thread(
    pool: SlotPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One mapping kept at most: mapping a second slot unmaps the least recently used one that
    # is not claimed. A claim found its mapping, and before it marked it claimed another
    # thread mapped the other slot: the claim's descriptor was closed under it (EBADF at its
    # flock). Finding and marking are now one step under the mappings' lock, so the other
    # thread waits and then leaves the claimed mapping alone.
    maps = SlotMappings(max_slots=1)
    first, _, _ = send(pool, "a", finish=False)  # keeps its slot: the next takes another
    _, other, _ = send(pool, "b", seed=1)
    d = first.finish()
    assert d is not None and other is not None and other.key != d.key
    sent_keys = {d.key, other.key}
    assert sent_keys == {s.path.name for s in pool.slots}
    other_path = next(s.path for s in pool.slots if s.path.name == other.key)
    verified = maps._verified
    through: list[bool] = []

    def racing(path: Path, generation: int, capability: bytes) -> Any:
        m = verified(path, generation, capability)
        if path.name == d.key and not through:
            rival = threading.Thread(
                target=maps.mapping, args=(other_path, other.generation, other.capability)
            )
            rival.start()
            # Unfixed, the rival maps its slot and unmaps this one at once; fixed, it waits
            # for the lock this claim holds, so it cannot finish now.
            rival.join(timeout=0.5)
            through.append(not rival.is_alive())
        return m

    monkeypatch.setattr(maps, "_verified", racing)
    got = receive(maps, d)
    assert through == [False]
    assert got.num_tokens == 6 and got.release is not None
    got.release()
    maps.close()
