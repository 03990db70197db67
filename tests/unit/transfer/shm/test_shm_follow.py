"""Reading an shm segment while its writer fills it (``shm_follow``, a prefetch)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np
import pytest

from pdserve.engine.kv_payload import KVPayload
from pdserve.errors import KVTransferError
from pdserve.transfer import pacing
from pdserve.transfer.shm import follow as shm_follow
from pdserve.transfer.shm import segment
from pdserve.transfer.shm.reader import SegmentReader
from pdserve.transfer.shm.writer import SegmentWriter
from tests.unit.transfer.conftest import (
    assert_same_payload,
    leftovers,
    make_layout,
    random_payload,
)

LAYERS = 4
PAYLOAD = random_payload(make_layout(num_layers=LAYERS), 9)


def following(
    prefix: str,
    *,
    pool: Executor | None = None,
    tamper: Callable[[np.ndarray], None] | None = None,
) -> tuple[SegmentWriter, SegmentReader, asyncio.Task[KVPayload]]:
    """A sender that has begun, and a reader following it from then on (call in a loop)."""
    sender = SegmentWriter(prefix=prefix)
    sender.tamper = tamper
    sender.begin("r", PAYLOAD.layout, PAYLOAD.num_tokens)
    receiver = SegmentReader(follow=True, pool=pool)
    reading = asyncio.create_task(receiver.receive(sender.planned(), 30.0))
    return sender, receiver, reading


def send_all(sender: SegmentWriter) -> None:
    for i in range(LAYERS):
        sender.send_layer(i, PAYLOAD.keys[i], PAYLOAD.values[i])
    sender.finish()


@pytest.mark.parametrize("threads", [0, 1])
def test_the_reader_follows_the_writer_to_a_verified_payload(shm_prefix: str, threads: int) -> None:
    """The read starts right after ``begin`` and ends once the segment is sealed."""

    async def body() -> None:
        with ThreadPoolExecutor(1) as pool:
            sender, _, reading = following(shm_prefix, pool=pool if threads else None)
            send_all(sender)
            assert_same_payload(await reading, PAYLOAD)
        assert leftovers(shm_prefix) == []  # the reader unlinked it at the seal

    asyncio.run(body())


def test_a_reader_before_the_reservation_waits_for_it(
    shm_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's mapper thread reserves the segment beside the compute: a reader told of
    the hand-off at once can find the file still empty, and must wait, not fail."""
    reserve, release = segment._reserve, threading.Event()
    waiting_size, waiting = shm_follow._reserved_size, threading.Event()

    def held_reserve(fd: int, size: int) -> None:
        release.wait(30)
        reserve(fd, size)

    def reader_waits(*args: object) -> int:
        waiting.set()  # the reservation is held back: the file is still empty here
        return waiting_size(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(segment, "_reserve", held_reserve)
    monkeypatch.setattr(shm_follow, "_reserved_size", reader_waits)

    async def body() -> None:
        sender, _, reading = following(shm_prefix)
        assert await asyncio.to_thread(waiting.wait, 30)
        release.set()
        send_all(sender)
        assert_same_payload(await reading, PAYLOAD)
        assert leftovers(shm_prefix) == []

    asyncio.run(body())


def test_a_writer_that_gives_up_ends_the_read(shm_prefix: str) -> None:
    async def body() -> None:
        sender, receiver, reading = following(shm_prefix)
        sender.send_layer(0, PAYLOAD.keys[0], PAYLOAD.values[0])
        sender.abort()
        with pytest.raises(KVTransferError, match=r"gave up|gone"):
            await reading
        receiver.cleanup()
        assert leftovers(shm_prefix) == []

    asyncio.run(body())


def test_cleanup_stops_a_reader_still_waiting(shm_prefix: str) -> None:
    async def body() -> None:
        sender, receiver, reading = following(shm_prefix)
        receiver.cleanup()  # before or while it waits for layer 0: it ends either way
        with pytest.raises(KVTransferError, match=r"cancelled|gone"):
            await reading
        sender.abort()
        assert leftovers(shm_prefix) == []

    asyncio.run(body())


def test_a_follow_read_that_gives_up_leaves_the_segment_to_its_writer(shm_prefix: str) -> None:
    """A prefetch bounded shorter than its prefill (a 32K prompt on a busy CPU) times out
    before the seal: the segment is still the writer's, and a plain read takes it once
    sealed, instead of the request falling back to recompute."""

    async def body() -> None:
        sender = SegmentWriter(prefix=shm_prefix)
        sender.begin("long", PAYLOAD.layout, PAYLOAD.num_tokens)
        sender.send_layer(0, PAYLOAD.keys[0], PAYLOAD.values[0])
        prefetch = SegmentReader(follow=True)
        with pytest.raises(KVTransferError, match="timed out"):
            await prefetch.receive(sender.planned(), 0.05)
        prefetch.cleanup()
        assert leftovers(shm_prefix) == [sender.name]
        for i in range(1, LAYERS):
            sender.send_layer(i, PAYLOAD.keys[i], PAYLOAD.values[i])
        descriptor = sender.finish()
        assert_same_payload(await SegmentReader().receive(descriptor, 30.0), PAYLOAD)
        assert leftovers(shm_prefix) == []

    asyncio.run(body())


def test_a_layer_changed_after_its_hash_fails_the_follow_read(shm_prefix: str) -> None:
    def flip(data: np.ndarray) -> None:
        data[-1] ^= 0xFF

    async def body() -> None:
        sender, receiver, reading = following(shm_prefix, tamper=flip)
        send_all(sender)
        with pytest.raises(KVTransferError, match="layer 0 failed its checksum"):
            await reading
        receiver.cleanup()
        assert leftovers(shm_prefix) == []

    asyncio.run(body())


class _Clock:
    """A fake ``time`` for ``shm_follow``: ``sleep`` advances ``monotonic`` and is logged."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("due_in", [None, 0.02, -1.0])
def test_the_waiter_polls_finely_only_while_the_mark_is_due(
    monkeypatch: pytest.MonkeyPatch, due_in: float | None
) -> None:
    """Sleeps of at most 100 us from ``due`` (None: now) for the near window, the backoff up
    to 2 ms before and after it."""
    clock = _Clock()
    monkeypatch.setattr(shm_follow, "time", clock)
    start = clock.now
    due = start if due_in is None else start + due_in
    waiter = shm_follow._Waiter("seg", start + 60, threading.Event(), lambda: False)
    polls = iter(range(1000))
    waiter.until(lambda: next(polls) == 999, "a mark", None if due_in is None else due)
    window = pacing.NEAR_WINDOW_S
    began = start
    fine = coarse = 0
    for i, slept in enumerate(clock.sleeps):
        assert slept <= pacing.WAIT_MAX_S
        if i and 0 <= began - due < window:
            assert slept <= pacing.WAIT_NEAR_S
            fine += 1
        elif slept > pacing.WAIT_NEAR_S:
            coarse += 1
        began += slept
    assert coarse > 0  # backed off before the window (0.02) or after it (now, long past)
    if due_in is not None and due_in < 0:
        assert fine == 0
    else:  # the whole window was polled finely
        assert fine >= (window - pacing.WAIT_MAX_S) / pacing.WAIT_NEAR_S - 2
