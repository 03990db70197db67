"""The decode worker's prefetches (``handoff.prefetch``): taken by the matching Decode call,
dropped otherwise, every read cancelled and its copy freed."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdserve.engine.kv_payload import KVPayload
from pdserve.errors import InvalidArgumentError
from pdserve.handoff.plan import TransferOptions
from pdserve.handoff.prefetch import TAKE_GRACE_S, Prefetch, Prefetches
from pdserve.transfer.base import HandoffRecord, KVLocation, TransferState, TransportKind


class FakeReceiver:
    """Receives once ``release`` is set; counts discards."""

    def __init__(self) -> None:
        self.kind = TransportKind.STORE
        self.record = HandoffRecord(TransportKind.STORE.value)
        self.state = TransferState.PENDING
        self.compression = "none"
        self.release = asyncio.Event()
        self.discarded = 0
        self.finished = False

    async def receive(self, timeout_s: float) -> KVPayload:
        await self.release.wait()
        self.finished = True
        return KVPayload.__new__(KVPayload)

    async def discard(self) -> None:
        self.discarded += 1


CAPABILITY = bytes(range(16))


def location(rid: str = "r", key: str = "kv/r") -> KVLocation:
    return KVLocation(
        TransportKind.STORE, rid, 8, 100, "fp", address="s:1", key=key, capability=CAPABILITY
    )


def test_the_matching_decode_call_takes_the_read() -> None:
    async def body() -> None:
        prefetches, inbound = Prefetches(), FakeReceiver()
        assert prefetches.start(location(), inbound, 10.0)
        assert not prefetches.start(location(), FakeReceiver(), 10.0)  # one per request
        taken = await prefetches.take(location())
        assert taken is not None and taken.receiver is inbound and len(prefetches) == 0
        inbound.release.set()
        await taken.task
        assert inbound.finished and inbound.discarded == 0  # the Decode call owns it now

    asyncio.run(body())


def test_a_decode_call_naming_another_location_drops_the_read() -> None:
    async def body() -> None:
        prefetches, inbound = Prefetches(), FakeReceiver()
        prefetches.start(location(), inbound, 10.0)
        moved = dataclasses.replace(location(), kind=TransportKind.RECOMPUTE, key="")
        assert await prefetches.take(moved) is None
        inbound.release.set()  # too late: the read was cancelled
        await asyncio.sleep(0)
        assert not inbound.finished and inbound.discarded == 1 and len(prefetches) == 0

    asyncio.run(body())


def test_a_stranger_naming_the_request_neither_takes_nor_drops_the_read() -> None:
    async def body() -> None:
        prefetches, inbound = Prefetches(), FakeReceiver()
        prefetches.start(location(), inbound, 10.0)
        forged = dataclasses.replace(location(), capability=bytes(16))  # all else right
        fallback = dataclasses.replace(forged, kind=TransportKind.RECOMPUTE, key="")
        for attempt in (forged, fallback):
            assert await prefetches.take(attempt) is None
        assert len(prefetches) == 1 and inbound.discarded == 0  # still the owner's
        taken = await prefetches.take(location())
        assert taken is not None and taken.receiver is inbound

    asyncio.run(body())


def test_close_cancels_and_frees_every_read() -> None:
    async def body() -> None:
        prefetches = Prefetches(max_pending=2)
        inbounds = [FakeReceiver() for _ in range(3)]
        started = [prefetches.start(location(f"r{i}"), b, 10.0) for i, b in enumerate(inbounds)]
        assert started == [True, True, False]  # the cap: the Decode call reads the third
        await prefetches.close()
        assert [b.discarded for b in inbounds] == [1, 1, 0]
        assert len(prefetches) == 0

    asyncio.run(body())


@pytest.mark.parametrize(
    ("done_at", "now", "expired"),
    [
        (0.0, 99.0, False),  # still reading, within its bound
        (0.0, 100.0, True),  # still reading, past its bound
        (50.0, 50.0 + TAKE_GRACE_S - 1, False),  # ended, its Decode call may be on its way
        (50.0, 50.0 + TAKE_GRACE_S, True),  # ended and never taken
    ],
)
def test_expiry(done_at: float, now: float, expired: bool) -> None:
    async def body() -> None:
        task = asyncio.get_running_loop().create_task(asyncio.sleep(0))
        prefetch = Prefetch(location(), FakeReceiver(), task, expires_at=100.0, done_at=done_at)
        assert prefetch.expired(now) is expired
        await task

    asyncio.run(body())


MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("changes", "kind", "address", "kv_bytes", "max_tokens", "announced"),
    [
        ({}, TransportKind.STORE, "d:1", 4 * MIB, 2, True),
        ({}, TransportKind.SHM, "d:1", 64 * MIB, 16, True),
        ({}, TransportKind.NIXL, "d:1", 64 * MIB, 16, True),  # read as the layers are marked
        ({"layerwise": False}, TransportKind.NIXL, "d:1", 64 * MIB, 16, False),
        ({}, TransportKind.DIRECT, "d:1", 64 * MIB, 16, False),  # arrives by itself
        ({}, TransportKind.RECOMPUTE, "d:1", 64 * MIB, 16, False),
        ({}, TransportKind.STORE, "", 64 * MIB, 16, False),  # no decode worker to tell
        ({}, TransportKind.STORE, "d:1", 4 * MIB - 1, 16, False),  # read faster afterwards
        ({}, TransportKind.SHM, "d:1", 64 * MIB, 1, False),  # no Decode call will come
        ({"prefetch": False}, TransportKind.SHM, "d:1", 64 * MIB, 16, False),
        ({"layerwise": False}, TransportKind.SHM, "d:1", 64 * MIB, 16, False),  # the baseline
        ({"prefetch_min_bytes": 0}, TransportKind.STORE, "d:1", 1, 2, True),
    ],
)
def test_which_hand_offs_are_announced(
    changes: dict[str, object],
    kind: TransportKind,
    address: str,
    kv_bytes: int,
    max_tokens: int,
    announced: bool,
) -> None:
    options = dataclasses.replace(TransferOptions(), **changes)
    got = options.announces(kind, decode_address=address, kv_bytes=kv_bytes, max_tokens=max_tokens)
    assert got is announced


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="prefetch_min_bytes"):
        TransferOptions(prefetch_min_bytes=-1)
