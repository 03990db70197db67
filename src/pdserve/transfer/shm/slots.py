"""Reused shm segments ("slots"): their lifecycle, and a prefill worker's pool of them.

Why: a fresh segment per hand-off makes both sides build page tables for each of its 4 KiB
pages. The writer's mapper thread does it beside the compute (tens of ms of a core for the
50 MB of 1K tokens of the base preset); the reader does it on the request's path, where
filling in a fresh mapping runs at about memcpy's rate, as slow as checking the bytes. A slot
is a segment file its writer keeps, mapped, for hand-off after hand-off, and a reader keeps
its own mapping of it (``SlotMappings``, ``slot_mappings.py``): the read is then the hash
alone.

Lifecycle of one slot, ``{prefix}{owner_pid}-s{n}`` (its state word and generation are in the
preamble, ``segment.py``; ``flock`` on the file guards the moves between writer and reader):

  1. Create (writer): ``SlotPool.create`` names a new slot within the pool's byte budget; the
     sender's mapper thread reserves and maps it as any segment, keeping its fd.
  2. Acquire (writer): ``SlotPool.acquire`` takes the smallest idle slot that fits if, under
     ``flock(LOCK_EX | LOCK_NB)`` (no reader holds it), it is FREE or ABORTED, CLAIMED (its
     reader died: the kernel dropped the reader's lock), or SEALED longer ago than the lease
     (its reader never came). -> WRITING; the hand-off's generation is the slot's next one.
  3. Write and seal (writer): as any segment; the descriptor carries the generation. The
     writer keeps the mapping.
  4. Claim (reader): ``SlotMappings.claim`` takes ``flock(LOCK_EX)`` and holds it until the
     release; the slot must be SEALED at the descriptor's generation, else the hand-off is
     gone (reused after its lease, revoked, not sealed), and hold the descriptor's
     capability, else the handle is not the writer's (``CapabilityError``; a slot this reader
     has not mapped yet is checked with a ``pread`` before it is mapped). -> CLAIMED.
  5. Read (reader): the checksums are checked on the kept mapping, and the payload's K and V
     are views over it (the engine's import is the one copy).
  6. Release (reader): once the engine imported the KV (``KVPayload.release``), the views are
     gone, or the read failed. -> FREE, unlock.
  7. Crashes: a dead reader's lock goes with it (step 2 takes the slot back); a dead writer's
     slots are the janitor's (``janitor.reclaim_orphans``: owner dead), and a reader drops
     its mappings of unlinked slots at its periodic sweep. ``SlotPool.close`` unlinks every
     slot.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import InvalidArgumentError
from pdserve.transfer.janitor import SEGMENT_PREFIX, SHM_DIR, SegmentState
from pdserve.transfer.shm import segment

logger = logging.getLogger(__name__)


def slot_capacity(size: int) -> int:
    """Bytes of a new slot for a ``size``-byte payload: rounded up to an eighth of its power
    of two (at most 1/8 more), so that payloads of nearby sizes share slots."""
    step = max(mmap.PAGESIZE, 1 << max(0, size.bit_length() - 4))
    return -(-size // step) * step


def slot_budget(requested: int, shm_dir: Path = SHM_DIR) -> int:
    """``requested`` bytes, at most a quarter of the file system under ``shm_dir`` (a
    container's ``/dev/shm`` may be 64 MiB): one-off segments need room too."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return 0
    return max(0, min(requested, st.f_blocks * st.f_frsize // 4))


@dataclass(eq=False)
class Slot:
    """One slot of the writer's pool."""

    name: str
    path: Path
    fd: int
    """Kept open: ``flock`` and the janitor's liveness need it."""
    capacity: int
    mm: mmap.mmap | None = None
    """Set by the sender once its mapper thread mapped the slot."""
    generation: int = 1
    """Of the hand-off being written (or last written)."""
    busy: bool = True
    """A sender of this process has it (until it seals or aborts)."""
    sealed_at: float = 0.0
    """``time.monotonic`` of the last seal (the lease counts from there)."""


class SlotPool:
    """A prefill worker's reused segments, within ``budget_bytes`` of ``/dev/shm``.

    Thread-safe. Payloads no slot fits (and no room for a new one) go in one-off segments.
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        lease_s: float = 60.0,
        shm_dir: Path = SHM_DIR,
        prefix: str = SEGMENT_PREFIX,
    ) -> None:
        if budget_bytes < 0:
            raise InvalidArgumentError("budget_bytes", f"must be >= 0, got {budget_bytes}")
        if not lease_s > 0:
            raise InvalidArgumentError("lease_s", f"must be > 0, got {lease_s}")
        self.budget_bytes = budget_bytes
        self.lease_s = lease_s
        """A slot sealed longer ago than this and not claimed may be written again."""
        self.shm_dir = shm_dir
        self.prefix = prefix
        self._slots: list[Slot] = []
        self._next = 0
        self._closed = False
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        """``/dev/shm`` bytes the pool's slots hold."""
        with self._lock:
            return self._held()

    @property
    def slots(self) -> list[Slot]:
        with self._lock:
            return list(self._slots)

    def acquire(self, size: int) -> Slot | None:
        """The smallest idle, mapped slot of at least ``size`` bytes that may be written again
        (lifecycle step 2), now WRITING and busy, its generation the next; None if none."""
        with self._lock:
            if self._closed:
                return None
            for slot in sorted(self._idle(size), key=lambda s: s.capacity):
                if os.fstat(slot.fd).st_nlink == 0:  # reclaimed under us (owner pid reused)
                    self._drop(slot)
                elif self._reclaim(slot):
                    slot.busy, slot.generation = True, slot.generation + 1
                    return slot
            return None

    def create(self, size: int) -> Slot | None:
        """A new, busy slot for ``size`` bytes (not mapped yet: ``segment.map_for_writing``
        with ``keep_fd``), making room by dropping idle slots if needed; None if the budget
        cannot hold it."""
        capacity = slot_capacity(size)
        with self._lock:
            if self._closed or capacity > self.budget_bytes:
                return None
            for victim in sorted(self._idle(0), key=lambda s: s.capacity):
                if self._held() + capacity <= self.budget_bytes:
                    break
                if self._reclaim(victim):
                    self._drop(victim)
            if self._held() + capacity > self.budget_bytes:
                return None
            name = f"{self.prefix}{os.getpid()}-s{self._next}"
            self._next += 1
            path = self.shm_dir / name
            slot = Slot(name, path, segment.create(path), capacity)
            self._slots.append(slot)
            return slot

    def sealed(self, slot: Slot) -> None:
        """The sender sealed ``slot``: its reader's now, until released or the lease passes."""
        slot.sealed_at = time.monotonic()
        slot.busy = False

    def aborted(self, slot: Slot) -> None:
        """The sender gave ``slot`` up (before or after sealing). A reader following it stops
        at the ABORTED mark; one that claimed it already keeps it until its release."""
        if slot.mm is None:  # never mapped: the slot is dropped, not reused
            with self._lock:
                self._drop(slot)
            return
        with self._lock:
            if try_lock(slot.fd):
                try:
                    segment.set_state(slot.mm, SegmentState.ABORTED)
                finally:
                    fcntl.flock(slot.fd, fcntl.LOCK_UN)
            slot.busy = False

    def expire(self) -> int:
        """Mark FREE every idle slot whose hand-off was SEALED longer ago than the lease and
        never claimed (its reader died or gave up); the number marked. Acquire would take such
        a slot back anyway; marking it on a timer keeps ``/dev/shm`` honest between hand-offs:
        a slot left SEALED would still show a hand-off in flight to the janitor and to leak
        checks. A reader holding the slot's lock keeps it (lifecycle step 4)."""
        expired = 0
        with self._lock:
            for slot in self._idle(0):
                if time.monotonic() - slot.sealed_at <= self.lease_s or not try_lock(slot.fd):
                    continue
                try:
                    assert slot.mm is not None  # _idle lists mapped slots only
                    if segment.mapped_state(slot.mm) is SegmentState.SEALED:
                        logger.info("shm slot %s: its hand-off was never read; freed", slot.name)
                        segment.set_state(slot.mm, SegmentState.FREE)
                        expired += 1
                finally:
                    fcntl.flock(slot.fd, fcntl.LOCK_UN)
        return expired

    def close(self) -> None:
        """Unlink and unmap every slot (idempotent); a reader's mapping keeps the memory of a
        slot it still holds until it lets go."""
        with self._lock:
            self._closed = True
            for slot in list(self._slots):
                self._drop(slot)

    def _held(self) -> int:
        return sum(s.capacity for s in self._slots)

    def _idle(self, size: int) -> list[Slot]:
        return [s for s in self._slots if not s.busy and s.mm is not None and s.capacity >= size]

    def _reclaim(self, slot: Slot) -> bool:
        """Whether ``slot`` may be written again; if so it is WRITING now (step 2)."""
        if slot.mm is None or not try_lock(slot.fd):
            return False  # its reader holds it
        try:
            # FREE, ABORTED, CLAIMED by a dead reader, or SEALED past the lease.
            state = segment.mapped_state(slot.mm)
            expired = time.monotonic() - slot.sealed_at > self.lease_s
            if state is not SegmentState.SEALED or expired:
                if state is SegmentState.SEALED:
                    logger.info("shm slot %s: its hand-off was never read; reused", slot.name)
                segment.set_state(slot.mm, SegmentState.WRITING)
                return True
            return False
        finally:
            fcntl.flock(slot.fd, fcntl.LOCK_UN)

    def _drop(self, slot: Slot) -> None:
        self._slots.remove(slot)
        segment.unlink(slot.path)
        segment.close_mapping(slot.mm)
        slot.mm = None
        os.close(slot.fd)


def try_lock(fd: int) -> bool:
    """``flock(LOCK_EX | LOCK_NB)`` on ``fd``: False if another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
