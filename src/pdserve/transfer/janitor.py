"""Shared-memory segment names, and reclaiming the segments crashed processes left behind.

A segment is named ``{prefix}{owner_pid}-{request_id_hash}`` (``pdserve-kv-4242-9f2c...``):
the owner pid lets any process on the host tell whether the writer still lives. Normally the
receiver unlinks a segment after reading it and the sender unlinks it on abort; a segment
outlives both only when a process died in between (SIGKILL, OOM kill) or a hand-off was never
picked up. ``reclaim_orphans`` removes such segments: the owner is gone, or the segment is older
than any hand-off may take.

Caveats: the owner check needs the janitor and the writers in one pid namespace (the same
container or the host); a recycled pid looks alive, so ``max_age_s`` is the backstop. Torch-free.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from pdserve.errors import InvalidArgumentError

SEGMENT_PREFIX = "pdserve-kv-"
SHM_DIR = Path("/dev/shm")
"""Where Linux keeps POSIX shared memory (``shm_open`` names are files here)."""


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


def owner_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 checks without sending anything)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, but belongs to another user
        return True
    return True


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
    """Unlink segments under ``prefix`` whose owner is dead or that are older than ``max_age_s``.

    ``max_age_s`` must exceed the longest hand-off (reservation to read); None keeps live
    owners' segments however old. Names under ``prefix`` without a pid expire by age only.
    Returns what was removed; a segment unlinked concurrently (its reader was faster) is
    skipped.
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
        if pid is not None and not owner_alive(pid):
            reason = ReclaimReason.OWNER_DEAD
        elif max_age_s is not None and age > max_age_s:
            reason = ReclaimReason.EXPIRED
        else:
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        removed.append(ReclaimedSegment(entry.name, pid, st.st_size, age, reason))
    return removed
