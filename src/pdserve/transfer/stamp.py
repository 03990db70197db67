"""The stamp of a segment's current hand-off: its generation and its capability.

Names and generations of shm segments are predictable (a pid, a hash of the request id, a
counter); the capability, 16 random bytes the writer puts in the segment (``segment.py``'s
layout, offset 32) and in the handle, is not. Whoever reads, claims, frees or unlinks a
segment on the strength of a handle checks the handle's capability against the segment's
first (``check_capability``, constant time), so a guessed handle gets ``CapabilityError``
(PERMISSION_DENIED) and touches nothing. ``read_stamp`` reads it with a ``pread``, so that a
reader can check a slot before it maps it.
"""

from __future__ import annotations

import hmac
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import CapabilityError, KVTransferError
from pdserve.transfer.janitor import MAGIC

GENERATION_OFFSET = 24
CAPABILITY_OFFSET = 32
CAPABILITY_BYTES = 16
HEADER_OFFSET = CAPABILITY_OFFSET + CAPABILITY_BYTES
"""Where the payload header starts (after the preamble and the capability)."""


def capability_bytes(capability: bytes) -> bytes:
    if len(capability) not in (0, CAPABILITY_BYTES):
        raise KVTransferError(f"a capability is {CAPABILITY_BYTES} bytes, got {len(capability)}")
    return capability or bytes(CAPABILITY_BYTES)


def capability_matches(found: bytes, expected: bytes) -> bool:
    """Whether ``expected`` (a handle's) is the capability ``found`` in a segment; compared in
    constant time."""
    return hmac.compare_digest(bytes(found), capability_bytes(expected))


def check_capability(found: bytes, expected: bytes, name: str) -> None:
    """Refuse (``CapabilityError``) a handle whose capability is not the segment's."""
    if not capability_matches(found, expected):
        raise CapabilityError(
            f"shm segment {name!r}: the handle's capability does not match its hand-off"
        )


def mapped_capability(mm: mmap.mmap) -> bytes:
    """The capability of the hand-off in a mapping (the current one, for a reused slot)."""
    return bytes(mm[CAPABILITY_OFFSET:HEADER_OFFSET])


@dataclass(frozen=True, slots=True)
class Stamp:
    """Who a segment's current hand-off is, read without mapping it."""

    generation: int
    capability: bytes


def read_stamp(path: Path) -> Stamp | None:
    """The generation and capability of the segment at ``path`` (a ``pread``, no mapping);
    None while its writer has not written them, if it is gone, or not a segment."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, HEADER_OFFSET, 0)
    finally:
        os.close(fd)
    if len(raw) < HEADER_OFFSET or raw[: len(MAGIC)] != MAGIC:
        return None
    (generation,) = struct.unpack_from("<Q", raw, GENERATION_OFFSET)
    return Stamp(int(generation), raw[CAPABILITY_OFFSET:HEADER_OFFSET])


def holds_capability(path: Path, capability: bytes) -> bool:
    """Whether the segment at ``path`` is the hand-off of ``capability`` (before a reader
    unlinks a segment it did not read)."""
    stamp = read_stamp(path)
    return stamp is not None and capability_matches(stamp.capability, capability)
