"""Reading an shm segment while its writer is still filling it (a prefetch).

The writer marks each layer once the layer and its checksum are in the segment
(``segment.mark_layer``), and the state word when it seals or gives up. A reader that learned
of the segment when the hand-off began (``Decode.Prefetch``) maps it privately and checks each
layer as soon as its mark appears, while the prefill still computes the later ones; at the
seal it holds a verified payload and only the last layer's check was left to wait for.

There is no cross-process wake-up in Python's standard library short of a socket, so the reader
polls the marks (its own thread, never the event loop) with a backoff from 50 us to 2 ms: a few
hundred cheap wake-ups a second while a long prefill computes. The layers come at the compute's
pace, so from the third one on the reader expects the next one once the previous interval has
nearly passed again (``transfer.pacing``), and from then on it polls every 100 us at most, for
up to 50 ms (a stalled writer then costs no CPU); so it does for the seal, which follows the
last layer at once. The last layer's check, the only one the request waits for, thus starts
within ~0.1 ms of its mark instead of up to 2 ms later (on a 1K-token hand-off of the base
preset, about half of the transfer time the request saw). ``stop`` (set by
``SegmentReader.cleanup``) ends the wait at once; so does an aborted writer; ``deadline``
bounds it. The hand-off's capability (``transfer.stamp``) is checked as soon as the writer has
written it, before any layer is read: a handle that is not the writer's gets
``CapabilityError``.
"""

from __future__ import annotations

import functools
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from pdserve.errors import KVTransferError
from pdserve.transfer import pacing
from pdserve.transfer.janitor import SegmentState
from pdserve.transfer.shm import segment
from pdserve.transfer.shm.checksum import combine, in_pair, layer_checksum
from pdserve.transfer.shm.populate import Populator
from pdserve.transfer.shm.segment import SegmentGeometry, SegmentHeader
from pdserve.transfer.shm.slot_mappings import SlotMappings, SlotNotReservedError
from pdserve.transfer.stamp import check_capability, mapped_capability


class _Waiter:
    """Polls a condition with a backoff until it holds, or the writer gave up (``gave_up``),
    the read was cancelled (``stop``) or ``deadline`` passed."""

    def __init__(
        self, name: str, deadline: float, stop: threading.Event, gave_up: Callable[[], bool]
    ) -> None:
        self.name, self.deadline, self.stop, self.gave_up = name, deadline, stop, gave_up

    def until(self, ready: Callable[[], bool], what: str, due: float | None = None) -> None:
        """Wait for ``ready()``, paced by ``transfer.pacing`` from the monotonic time ``due``
        on (None: now)."""
        delay = pacing.WAIT_MIN_S
        due = time.monotonic() if due is None else due
        while not ready():
            if self.gave_up():
                raise KVTransferError(f"shm segment {self.name!r}: its writer gave up")
            if self.stop.is_set():
                raise KVTransferError(f"shm read of {self.name!r} was cancelled")
            if time.monotonic() > self.deadline:
                raise KVTransferError(f"shm read of {self.name!r} timed out waiting for {what}")
            time.sleep(delay)
            delay = pacing.next_wait(delay, due, time.monotonic())


def follow_segment(
    path: Path,
    deadline: float,
    stop: threading.Event,
    pool: Executor | None = None,
    *,
    capability: bytes = b"",
) -> tuple[mmap.mmap, SegmentHeader]:
    """Check every layer of the segment at ``path`` as its writer marks it, until it is
    sealed (see the module docstring): the private mapping and what the segment says.
    ``KVTransferError`` if it is gone, aborted, corrupt or late; the caller unlinks it (it is
    the reader's once sealed)."""
    name = path.name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise KVTransferError(f"shm segment {name!r} is gone (aborted or reclaimed)") from None
    try:
        # Before the mapping, a writer that gave up has unlinked the file.
        size = _reserved_size(fd, _Waiter(name, deadline, stop, lambda: not path.exists()))
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)

    try:
        wait = _Waiter(name, deadline, stop, lambda: aborted(mm))
        return _follow(mm, name, wait, pool, capability)
    except BaseException:
        segment.close_mapping(mm)
        raise


def mapped_when_reserved(
    slots: SlotMappings,
    path: Path,
    generation: int,
    capability: bytes,
    deadline: float,
    stop: threading.Event,
) -> mmap.mmap:
    """The reader's kept mapping of the slot at ``path``, once its writer has reserved it (a
    new slot is reserved beside the compute, as a one-off segment is) and, for a slot not
    mapped yet, started the hand-off of ``generation`` with ``capability``."""
    found: list[mmap.mmap] = []

    def mapped() -> bool:
        try:
            found.append(slots.mapping(path, generation, capability))
        except SlotNotReservedError:
            return False
        return True

    _Waiter(path.name, deadline, stop, lambda: not path.exists()).until(
        mapped, "its writer's reservation"
    )
    return found[-1]


def follow_slot(
    mm: mmap.mmap,
    name: str,
    generation: int,
    deadline: float,
    stop: threading.Event,
    pool: Executor | None = None,
    *,
    capability: bytes = b"",
    populate: bool = True,
) -> SegmentHeader:
    """``follow_segment`` for the hand-off of ``generation`` in a reused slot, over the
    reader's kept mapping ``mm`` (``slot_mappings.py``): it waits for the writer to start that
    generation; the writer gave up if it aborts it or starts a later one. The caller claims
    the slot once this returns (sealed)."""

    def mine() -> bool:
        return segment.mapped_generation(mm) == generation

    def gave_up() -> bool:
        now = segment.mapped_generation(mm)
        return now > generation or (now == generation and aborted(mm))

    wait = _Waiter(name, deadline, stop, gave_up)
    wait.until(mine, "its writer to start")
    _, head = _follow(mm, name, wait, pool, capability, populate=populate)
    if not mine():
        raise KVTransferError(f"shm slot {name!r}: its writer gave up")
    return head


def aborted(mm: mmap.mmap) -> bool:
    return segment.mapped_state(mm) is SegmentState.ABORTED


def _reserved_size(fd: int, wait: _Waiter) -> int:
    """The segment's size once its writer has reserved it: the writer's mapper thread does
    that beside the compute, all at once, so a reader told of the hand-off as it began may
    open the file while it is still empty."""
    wait.until(lambda: os.fstat(fd).st_size > 0, "its writer's reservation")
    return os.fstat(fd).st_size


def _marked(mm: mmap.mmap, geom: SegmentGeometry, layer: int) -> bool:
    return segment.mapped_layer(mm, geom, layer) is not None


def _populated_checksum(populate: Populator | None, at: int, part: memoryview) -> int:
    if populate is not None:
        populate(at, len(part))
    return layer_checksum(part)


def _follow(
    mm: mmap.mmap,
    name: str,
    wait: _Waiter,
    pool: Executor | None,
    capability: bytes,
    *,
    populate: bool = True,
) -> tuple[mmap.mmap, SegmentHeader]:
    wait.until(lambda: segment.mapped_state(mm) is not None, "its header")
    check_capability(mapped_capability(mm), capability, name)
    layout, num_tokens, geom = segment.mapped_header(mm, name)
    fill = Populator(mm) if populate else None
    half = geom.layer_bytes // 2
    checksums = []
    seen: list[float] = []  # when each mark was found
    with memoryview(mm) as whole:
        for i in range(geom.num_layers):
            due = pacing.due_after(seen)
            wait.until(functools.partial(_marked, mm, geom, i), f"layer {i}", due)
            seen.append(time.monotonic())
            expected = segment.mapped_layer(mm, geom, i)
            at = geom.layer_offset(i)
            k, v = whole[at : at + half], whole[at + half : at + 2 * half]
            try:
                kd, vd = in_pair(
                    pool,
                    functools.partial(_populated_checksum, fill, at, k),
                    functools.partial(_populated_checksum, fill, at + half, v),
                )
            finally:
                k.release()
                v.release()
            if expected is None or combine(kd, vd) != expected:
                raise KVTransferError(f"KV layer {i} failed its checksum")
            checksums.append(expected)
    wait.until(lambda: segment.mapped_state(mm) is SegmentState.SEALED, "the seal")
    return mm, SegmentHeader(layout, num_tokens, geom, tuple(checksums))
