"""Shared-memory segment names, and reclaiming the segments crashed processes left behind.

A segment is named ``{prefix}{owner_pid}-{request_id_hash}`` (``pdserve-kv-4242-9f2c...``):
the owner pid lets any process on the host tell whether the writer still lives. Normally the
receiver unlinks a segment after reading it and the sender unlinks it on abort; a segment
outlives both only when a process died in between (SIGKILL, OOM kill) or a hand-off was never
picked up. ``reclaim_orphans`` removes such segments: the owner is gone, or the segment was
sealed (handed over) longer ago than any reader may take.

A reused slot (``{prefix}{owner_pid}-s{n}``, ``slots.py``) lives as long as its writer: its
live owner expires what no reader took itself (its pool is its reservation of ``/dev/shm``),
and the janitor reclaims it only when the owner is dead.

A segment its live owner is still writing is never reclaimed by age: a long prompt's prefill
(minutes on a CPU) keeps it unsealed for as long as it computes, and its writer seals or
unlinks it on every path. The writer refreshes the segment's mtime as it seals, so the age
counts from the hand-off, not from the reservation.

Caveats: the owner check needs the janitor and the writers in one pid namespace (the same
container or the host). A recycled pid is told apart on Linux by its start time: a process
that started after the segment's last change cannot be the one that wrote it. Torch-free.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from pathlib import Path

from pdserve.errors import InvalidArgumentError

SEGMENT_PREFIX = "pdserve-kv-"
SHM_DIR = Path("/dev/shm")
"""Where Linux keeps POSIX shared memory (``shm_open`` names are files here)."""

MAGIC = b"PDSHMKV5"  # 4: flags and a generation (reused slots); 5: the hand-off's capability
"""A segment's first bytes (``segment.py`` has the whole format); its state word follows."""
STATE_OFFSET = 8


class SegmentState(IntEnum):
    """A segment's state word: being written, handed over (sealed), given up; a reused slot
    (``slots.py``) also: held by its reader, and free for its writer again."""

    WRITING = 0
    SEALED = 1
    ABORTED = 2
    CLAIMED = 3
    FREE = 4


def parse_state(preamble: bytes) -> SegmentState | None:
    """The state in a segment's first bytes; None before its writer wrote them, or if they
    are not a segment's."""
    if len(preamble) < STATE_OFFSET + 4 or preamble[:STATE_OFFSET] != MAGIC:
        return None
    state = int.from_bytes(preamble[STATE_OFFSET : STATE_OFFSET + 4], "little")
    return SegmentState(state) if state in SegmentState._value2member_map_ else None


HANDED_OVER = (SegmentState.SEALED, SegmentState.ABORTED)
"""States in which the writer is done with a segment."""

_CLOCK_SLACK_S = 2.0
"""Error allowed between a process's start time (whole seconds of boot time plus clock ticks)
and file times, before a pid counts as recycled."""


def segment_name(
    request_id: str, *, owner_pid: int | None = None, prefix: str = SEGMENT_PREFIX
) -> str:
    """The segment name of ``request_id`` written by ``owner_pid`` (default: this process).

    The request id is hashed: it may hold characters a file name cannot, or be long.
    """
    if not request_id:
        raise InvalidArgumentError("request_id", "must not be empty")
    if "/" in prefix or not prefix:
        raise InvalidArgumentError("prefix", f"must be a non-empty file name part, got {prefix!r}")
    pid = os.getpid() if owner_pid is None else owner_pid
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).hexdigest()
    return f"{prefix}{pid}-{digest}"


def parse_owner_pid(name: str, prefix: str = SEGMENT_PREFIX) -> int | None:
    """The owner pid in a segment name, or None if the name is not one of ours."""
    if not name.startswith(prefix):
        return None
    pid, sep, digest = name[len(prefix) :].partition("-")
    if not (sep and digest and pid.isdigit()):
        return None
    return int(pid)


def owner_alive(pid: int, *, since: float | None = None) -> bool:
    """Whether process ``pid`` exists (signal 0 checks without sending anything) and, given
    ``since`` (a wall-clock time the owner was known to live), started before it: a process
    started later holds a recycled pid (Linux only; elsewhere any live pid counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but belongs to another user
        pass
    if since is None:
        return True
    started = process_start_time(pid)
    return started is None or started <= since + _CLOCK_SLACK_S


@functools.cache
def _boot_time() -> float | None:
    """When this host booted (``time.time`` scale, whole seconds), from ``/proc/stat``."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        return next(float(line.split()[1]) for line in lines if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (``time.time`` scale), from ``/proc``; None if unknown."""
    boot = _boot_time()
    if boot is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # Field 22 (starttime, clock ticks after boot); the command name (field 2) may hold
        # spaces and parentheses, so count from its closing one.
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def segment_state(path: str | Path) -> SegmentState | None:
    """The state of the segment at ``path``; None before its writer wrote the preamble, or
    if it is not a segment (or gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return parse_state(os.pread(fd, STATE_OFFSET + 4, 0))
    finally:
        os.close(fd)


def is_slot(name: str, prefix: str = SEGMENT_PREFIX) -> bool:
    """Whether ``name`` is a reused slot's (``{prefix}{pid}-s{n}``, ``slots.py``)."""
    return parse_owner_pid(name, prefix) is not None and name.rpartition("-")[2][:1] == "s"


def holds_hand_off(path: Path, prefix: str = SEGMENT_PREFIX) -> bool:
    """Whether the segment at ``path`` holds a hand-off: any one-off segment, and a reused
    slot being written, sealed or claimed (a live writer keeps its slots FREE or ABORTED
    between hand-offs). What a leak check counts."""
    if not path.exists():
        return False
    return not is_slot(path.name, prefix) or segment_state(path) not in (
        SegmentState.FREE,
        SegmentState.ABORTED,
    )


class ReclaimReason(StrEnum):
    OWNER_DEAD = "owner_dead"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class ReclaimedSegment:
    """One segment the janitor unlinked, and why."""

    name: str
    owner_pid: int | None
    num_bytes: int
    age_s: float
    reason: ReclaimReason


def reclaim_orphans(
    prefix: str = SEGMENT_PREFIX,
    max_age_s: float | None = 600.0,
    *,
    shm_dir: Path = SHM_DIR,
    now: float | None = None,
) -> list[ReclaimedSegment]:
    """Unlink segments under ``prefix`` whose owner is dead (or its pid recycled), and live
    owners' segments sealed more than ``max_age_s`` ago (handed over, never read).

    ``max_age_s`` must exceed the longest wait from a hand-off to its read; None keeps live
    owners' segments however old. A segment still being written is its live owner's (see the
    module docstring). Names under ``prefix`` without a pid expire by age only. Returns what
    was removed; a segment unlinked concurrently (its reader was faster) is skipped.
    """
    if max_age_s is not None and not max_age_s > 0:
        raise InvalidArgumentError("max_age_s", f"must be > 0 or None, got {max_age_s}")
    if not shm_dir.is_dir():
        return []
    clock = time.time() if now is None else now
    removed: list[ReclaimedSegment] = []
    for entry in os.scandir(shm_dir):
        if not entry.name.startswith(prefix):
            continue
        pid = parse_owner_pid(entry.name, prefix)
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        age = clock - st.st_mtime
        if pid is not None and not owner_alive(pid, since=st.st_mtime):
            reason = ReclaimReason.OWNER_DEAD
        elif (
            max_age_s is not None
            and age > max_age_s
            and not is_slot(entry.name, prefix)  # a live writer's pool
            and (pid is None or segment_state(entry.path) in HANDED_OVER)
        ):
            reason = ReclaimReason.EXPIRED
        else:
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        removed.append(ReclaimedSegment(entry.name, pid, st.st_size, age, reason))
    return removed
