"""Reused shm segments ("slots"): a prefill worker's pool of them, and a reader's claim on one.

Why: a fresh segment per hand-off makes both sides build page tables for each of its 4 KiB
pages. The writer's mapper thread does it beside the compute (tens of ms of a core for the
50 MB of 1K tokens of the base preset); the reader does it on the request's path, where
filling in a fresh mapping runs at about memcpy's rate, as slow as checking the bytes. A slot
is a segment file its writer keeps, mapped, for hand-off after hand-off, and a reader keeps
its own mapping of it (``SlotMappings``): the read is then the hash alone.

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

import contextlib
import fcntl
import logging
import mmap
import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import CapabilityError, InvalidArgumentError, KVTransferError
from pdserve.transfer.janitor import SEGMENT_PREFIX, SHM_DIR, SegmentState
from pdserve.transfer.shm import segment
from pdserve.transfer.stamp import (
    capability_matches,
    check_capability,
    mapped_capability,
    read_stamp,
)

logger = logging.getLogger(__name__)

_LOCK_WAIT_MIN_S = 20e-6
_LOCK_WAIT_MAX_S = 1e-3


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
            if _try_lock(slot.fd):
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
                if time.monotonic() - slot.sealed_at <= self.lease_s or not _try_lock(slot.fd):
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
        if slot.mm is None or not _try_lock(slot.fd):
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


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


# -- the reader's side -------------------------------------------------------------------------
class SlotNotReservedError(KVTransferError):
    """A new slot whose writer has not reserved its bytes yet (a follow-read waits)."""


@dataclass(eq=False)
class _Mapping:
    fd: int
    mm: mmap.mmap
    ino: int
    claimed: bool = False
    populated: bool = False
    """Its page tables are filled in (a read went through it): no need to again."""

    def __post_init__(self) -> None:
        # The fd goes with the mapping: forgotten, or garbage with its ``SlotMappings`` (a
        # receiver's one-read mappings) once its last payload view is gone.
        self.close_fd = weakref.finalize(self, os.close, self.fd)


class Claim:
    """A reader's hold on one sealed slot (lifecycle steps 4-6); ``release`` ends it."""

    def __init__(self, owner: SlotMappings, mapping: _Mapping, name: str) -> None:
        self._owner, self._mapping, self.name = owner, mapping, name
        self._released = False

    @property
    def mm(self) -> mmap.mmap:
        return self._mapping.mm

    @property
    def populated(self) -> bool:
        return self._mapping.populated

    def populated_now(self) -> None:
        self._mapping.populated = True

    def release(self) -> None:
        """FREE, unlocked: the writer may use the slot again (idempotent, any thread)."""
        with self._owner._lock:
            if self._released:
                return
            self._released = True
            m = self._mapping
            with contextlib.suppress(ValueError):  # the mapping was closed at shutdown
                segment.set_state(m.mm, SegmentState.FREE)
            with contextlib.suppress(OSError):
                fcntl.flock(m.fd, fcntl.LOCK_UN)
            m.claimed = False


class SlotMappings:
    """A reader's mappings of writers' slots, kept between hand-offs (at most ``max_slots``,
    least recently used dropped first). Thread-safe; one per reading process."""

    def __init__(self, max_slots: int = 64) -> None:
        if max_slots < 1:
            raise InvalidArgumentError("max_slots", f"must be >= 1, got {max_slots}")
        self.max_slots = max_slots
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        # Reentrant: a release may run from a garbage collection inside a locked section.
        self._lock = threading.RLock()

    @property
    def num_mappings(self) -> int:
        return len(self._maps)

    def mapping(self, path: Path, generation: int, capability: bytes) -> mmap.mmap:
        """The kept mapping of the slot at ``path``; a slot not mapped yet is mapped only
        once it holds the hand-off of ``generation`` with ``capability``
        (``SlotNotReservedError`` before, ``CapabilityError`` for another capability)."""
        if path.name not in self._maps:
            stamp = read_stamp(path)
            if stamp is None or stamp.generation != generation:
                raise SlotNotReservedError(f"shm slot {path.name!r} is not at the hand-off yet")
            check_capability(stamp.capability, capability, path.name)
        return self._get(path).mm

    def _verified(self, path: Path, generation: int, capability: bytes) -> _Mapping:
        """The mapping of the slot at ``path``, made only if a ``pread`` finds the hand-off
        of ``generation`` with ``capability`` in it (raises otherwise)."""
        if path.name not in self._maps:
            stamp = read_stamp(path)
            if stamp is None:
                raise KVTransferError(f"shm slot {path.name!r} is gone or not begun")
            if stamp.generation != generation:
                raise KVTransferError(
                    f"shm slot {path.name!r} holds another hand-off now (its own expired "
                    f"or was revoked)"
                )
            check_capability(stamp.capability, capability, path.name)
        return self._get(path)

    def populated(self, path: Path) -> bool:
        """Whether a read went through the kept mapping of ``path`` already."""
        m = self._maps.get(path.name)
        return m is not None and m.populated

    def claim(self, path: Path, generation: int, capability: bytes, deadline: float) -> Claim:
        """Hold the slot at ``path`` for the hand-off of ``generation`` (step 4); waits for
        its lock until ``deadline`` (``time.monotonic``). ``KVTransferError`` if the slot is
        gone, held, or holds another hand-off (or this one unsealed); ``CapabilityError`` if
        ``capability`` is not the hand-off's."""
        name = path.name
        with self._lock:  # found and marked in one step: no other thread unmaps it between
            m = self._verified(path, generation, capability)
            if segment.mapped_generation(m.mm) == generation:  # first, whoever holds it now
                check_capability(mapped_capability(m.mm), capability, name)
            if m.claimed:
                raise KVTransferError(f"shm slot {name!r} is already claimed by this reader")
            m.claimed = True
        claim = Claim(self, m, name)
        try:
            _lock(m.fd, deadline, name)
        except BaseException:
            m.claimed = False
            raise
        try:
            _check_claimable(m.mm, generation, capability, name)
        except BaseException:
            fcntl.flock(m.fd, fcntl.LOCK_UN)
            m.claimed = False
            raise
        segment.set_state(m.mm, SegmentState.CLAIMED)
        return claim

    def discard(self, path: Path, generation: int, capability: bytes) -> bool:
        """Free the hand-off of ``generation`` if it is sealed, nobody claimed it and it has
        ``capability``: its reader gives it up unread (a refused request, a failed
        follow-read). True if it did; anything else (gone, claimed, being written, another
        hand-off or capability) is left as it is."""
        with self._lock:  # found and marked in one step (``claim``)
            try:
                m = self._verified(path, generation, capability)
            except (KVTransferError, CapabilityError):  # gone, moved on, or not this handle's
                return False
            if m.claimed:  # this process holds it: its payload's release frees it
                return False
            m.claimed = True
        try:
            if not _try_lock(m.fd):
                return False
            try:
                sealed = segment.mapped_state(m.mm) is SegmentState.SEALED
                mine = capability_matches(mapped_capability(m.mm), capability)
                if sealed and mine and segment.mapped_generation(m.mm) == generation:
                    segment.set_state(m.mm, SegmentState.FREE)
                    return True
                return False
            finally:
                fcntl.flock(m.fd, fcntl.LOCK_UN)
        finally:
            m.claimed = False

    def close(self) -> None:
        """Unmap every slot not claimed (a claimed one goes with its views)."""
        with self._lock:
            for name in list(self._maps):
                if not self._maps[name].claimed:
                    self._forget(name)

    def _get(self, path: Path) -> _Mapping:
        with self._lock:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise KVTransferError(f"shm slot {path.name!r} is gone") from None
            m = self._maps.get(path.name)
            if m is not None and m.ino == st.st_ino and len(m.mm) >= st.st_size:
                self._maps.move_to_end(path.name)
                return m
            if m is not None and not m.claimed:
                self._forget(path.name)
            if st.st_size == 0:  # a new slot its writer's mapper has not reserved yet
                raise SlotNotReservedError(f"shm slot {path.name!r} is not sealed (not begun)")
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                raise KVTransferError(f"shm slot {path.name!r} is gone") from None
            try:
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED)
            except (OSError, ValueError) as err:
                os.close(fd)
                raise KVTransferError(f"shm slot {path.name!r} cannot be mapped: {err}") from err
            m = _Mapping(fd, mm, st.st_ino)
            self._maps[path.name] = m
            while len(self._maps) > self.max_slots:
                oldest = next((n for n, x in self._maps.items() if not x.claimed), None)
                if oldest is None or oldest == path.name:
                    break
                self._forget(oldest)
            return m

    def sweep(self) -> None:
        """Drop mappings of slots their writer (or the janitor) unlinked: the mapping would
        keep their memory (the decode worker runs this every second)."""
        with self._lock:
            for name, m in list(self._maps.items()):
                if not m.claimed and os.fstat(m.fd).st_nlink == 0:
                    self._forget(name)

    def _forget(self, name: str) -> None:
        m = self._maps.pop(name)
        segment.close_mapping(m.mm)
        m.close_fd()


def _lock(fd: int, deadline: float, name: str) -> None:
    """``flock(LOCK_EX)`` on ``fd``, polling until ``deadline``: the writer holds it for
    microseconds; another reader (a duplicated hand-off) for as long as its import takes."""
    delay = _LOCK_WAIT_MIN_S
    while not _try_lock(fd):
        if time.monotonic() > deadline:
            raise KVTransferError(f"shm slot {name!r} is held by another reader")
        time.sleep(delay)
        delay = min(2 * delay, _LOCK_WAIT_MAX_S)


def _check_claimable(mm: mmap.mmap, generation: int, capability: bytes, name: str) -> None:
    state, current = segment.mapped_state(mm), segment.mapped_generation(mm)
    if current != generation:
        raise KVTransferError(
            f"shm slot {name!r} holds another hand-off now (its own expired or was revoked)"
        )
    check_capability(mapped_capability(mm), capability, name)
    if state is SegmentState.SEALED:
        return
    if state is SegmentState.WRITING:
        raise KVTransferError(f"shm slot {name!r} is not sealed (its writer never finished)")
    if state is SegmentState.ABORTED:
        raise KVTransferError(f"shm slot {name!r}: its writer gave the hand-off up")
    raise KVTransferError(f"shm slot {name!r} was read already")
