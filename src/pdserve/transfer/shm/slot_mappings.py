"""A reader's side of the reused shm slots: its kept mappings of them, and its claim on one.

Owns lifecycle steps 4 to 6 of ``slots.py`` (claim, read, release) and the reader's half of
step 7 (dropping mappings of unlinked slots); the writer's ``SlotPool`` stays there. The two
sides run in different processes and share only the file, its preamble and its ``flock``.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import CapabilityError, InvalidArgumentError, KVTransferError
from pdserve.transfer.janitor import SegmentState
from pdserve.transfer.shm import segment
from pdserve.transfer.shm.slots import try_lock
from pdserve.transfer.stamp import (
    capability_matches,
    check_capability,
    mapped_capability,
    read_stamp,
)

_LOCK_WAIT_MIN_S = 20e-6
_LOCK_WAIT_MAX_S = 1e-3


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
            if not try_lock(m.fd):
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
    while not try_lock(fd):
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
