"""Capabilities of shm hand-offs (``transfer.stamp``): a handle whose capability is not the
writer's reads, claims, frees, unlinks and maps nothing, whatever else it guessed right
(the segment's name, a slot's generation), and the writer's own handle still works after."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from pdserve.engine.kv_payload import KVPayload
from pdserve.errors import CapabilityError
from pdserve.transfer.base import KVLocation
from pdserve.transfer.janitor import SEGMENT_PREFIX, SHM_DIR, SegmentState, segment_state
from pdserve.transfer.shm.follow import follow_segment
from pdserve.transfer.shm.handoff import ShmReceiver
from pdserve.transfer.shm.reader import SegmentReader
from pdserve.transfer.shm.slot_mappings import SlotMappings
from pdserve.transfer.shm.slots import SlotPool
from pdserve.transfer.shm.writer import SegmentWriter
from pdserve.transfer.stamp import CAPABILITY_BYTES, read_stamp
from tests.unit.transfer.conftest import (
    assert_same_payload,
    leftovers,
    make_layout,
    random_payload,
)

LAYOUT = make_layout(num_layers=3)


def guessed(d: KVLocation) -> KVLocation:
    """``d`` with everything right but the capability (a stranger's best guess)."""
    return dataclasses.replace(d, capability=secrets.token_bytes(CAPABILITY_BYTES))


def written(
    shm_prefix: str, rid: str, pool: SlotPool | None = None, seed: int = 0
) -> tuple[KVLocation, KVPayload]:
    payload = random_payload(LAYOUT, 6, seed)
    sender = SegmentWriter(prefix=shm_prefix, slots=pool)
    sender.begin(rid, LAYOUT, 6)
    for i in range(LAYOUT.num_layers):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    return sender.finish(), payload


def release(payload: KVPayload) -> None:
    """What the engine's import does with a slot's payload: lets the slot go."""
    assert payload.release is not None
    payload.release()


@pytest.fixture
def pool(shm_prefix: str) -> Iterator[SlotPool]:
    slots = SlotPool(64 << 20, lease_s=30.0, prefix=shm_prefix)
    yield slots
    slots.close()


def test_every_hand_off_has_its_own_random_capability(shm_prefix: str, pool: SlotPool) -> None:
    d1, _ = written(shm_prefix, "a", pool)
    stamp = read_stamp(SHM_DIR / d1.key)
    assert stamp is not None and stamp.capability == d1.capability
    assert len(d1.capability) == CAPABILITY_BYTES
    release(asyncio.run(SegmentReader(slots=SlotMappings()).receive(d1, 5.0)))
    d2, _ = written(shm_prefix, "b", pool, seed=1)
    assert d2.key == d1.key and d2.generation == d1.generation + 1  # same slot, next one
    assert d2.capability != d1.capability


def test_a_guessed_one_off_handle_is_refused_and_touches_nothing(shm_prefix: str) -> None:
    d, sent = written(shm_prefix, "victim")
    for follow in (False, True):
        with pytest.raises(CapabilityError):
            asyncio.run(SegmentReader(follow=follow).receive(guessed(d), 5.0))
    assert leftovers(shm_prefix) == [d.key]  # not unlinked: still the victim's
    rx = SegmentReader(follow=False)
    with pytest.raises(CapabilityError):
        asyncio.run(rx.receive(guessed(d), 5.0))
    rx.cleanup()  # a failed reader's clean-up leaves another hand-off's segment alone
    assert segment_state(SHM_DIR / d.key) is SegmentState.SEALED
    got = asyncio.run(SegmentReader().receive(d, 5.0))  # the real handle still works
    assert_same_payload(got, sent)
    assert leftovers(shm_prefix) == []


def test_guessed_generations_of_a_slot_are_refused_without_a_mapping(
    shm_prefix: str, pool: SlotPool
) -> None:
    d, sent = written(shm_prefix, "victim", pool)
    maps = SlotMappings()
    for generation in range(1, 65):  # every small generation, the right one among them
        attempt = dataclasses.replace(guessed(d), generation=generation)
        with pytest.raises(Exception) as err:
            asyncio.run(SegmentReader(slots=maps).receive(attempt, 5.0))
        assert isinstance(err.value, CapabilityError) == (generation == d.generation)
    assert maps.num_mappings == 0  # never mapped on a guess
    assert segment_state(SHM_DIR / d.key) is SegmentState.SEALED
    assert not maps.discard(SHM_DIR / d.key, d.generation, guessed(d).capability)
    assert segment_state(SHM_DIR / d.key) is SegmentState.SEALED  # not freed either
    got = asyncio.run(SegmentReader(slots=maps).receive(d, 5.0))
    assert_same_payload(got, sent)
    release(got)


def test_a_mapped_slot_still_refuses_a_guessed_capability(shm_prefix: str, pool: SlotPool) -> None:
    maps = SlotMappings()
    d1, _ = written(shm_prefix, "first", pool)
    release(asyncio.run(SegmentReader(slots=maps).receive(d1, 5.0)))
    assert maps.num_mappings == 1  # kept: the next hand-off in the slot reads on it
    d2, sent = written(shm_prefix, "second", pool, seed=2)
    for follow in (False, True):
        with pytest.raises(CapabilityError):
            asyncio.run(SegmentReader(slots=maps, follow=follow).receive(guessed(d2), 5.0))
    assert segment_state(SHM_DIR / d2.key) is SegmentState.SEALED
    got = asyncio.run(SegmentReader(slots=maps).receive(d2, 5.0))
    assert_same_payload(got, sent)
    release(got)


def test_a_follower_with_a_guessed_capability_stops_before_any_layer(shm_prefix: str) -> None:
    payload = random_payload(LAYOUT, 6)
    sender = SegmentWriter(prefix=shm_prefix)
    sender.begin("victim", LAYOUT, 6)
    wrong = guessed(sender.planned())
    with pytest.raises(CapabilityError):
        follow_segment(
            SHM_DIR / sender.name, time.monotonic() + 10, threading.Event(),
            capability=wrong.capability,
        )  # fmt: skip
    for i in range(LAYOUT.num_layers):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    d = sender.finish()
    assert_same_payload(asyncio.run(SegmentReader().receive(d, 5.0)), payload)


def test_a_refused_decode_call_with_a_guessed_handle_unlinks_nothing() -> None:
    # A real segment name (the decode worker only ever unlinks pdserve's own names).
    d, _ = written(SEGMENT_PREFIX, f"victim-{uuid.uuid4().hex}")
    path = SHM_DIR / d.key
    try:
        stranger = guessed(d)
        asyncio.run(ShmReceiver(SegmentReader(), stranger).discard())  # refused before any read
        assert path.exists()
        owner = d
        asyncio.run(ShmReceiver(SegmentReader(), owner).discard())
        assert not path.exists()
    finally:
        path.unlink(missing_ok=True)
