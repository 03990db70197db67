"""One entry of the KV store: its in-memory record, what a reader gets, what ``stat`` says, and
the lease it gets (``Leases``, a decode worker's inbox's too)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from pdserve.errors import InvalidArgumentError
from pdserve.kvstore.disk import DiskTier


class Tier(StrEnum):
    RAM = "ram"
    DISK = "disk"


Part = tuple[bytes | bytearray | memoryview, int | None]
"""A piece of an entry's data as it was written, with its CRC-32 if known (the chunk's)."""


@dataclass(frozen=True, slots=True)
class StoredPayload:
    """One entry as read: the opaque header and data, and when its lease ends.

    The data is kept in the pieces it was written in (``parts``), each with its CRC-32 when
    known, so that a reader can stream it on without copying or checksumming it again.
    """

    key: str
    header: bytes
    parts: tuple[Part, ...]
    expires_at: float
    """On the store's clock."""
    version: int
    """Increases with every write, so that a reader can delete exactly what it read."""
    attachment: object | None = None
    """What the writer attached in memory (``PendingPut.commit``); None once spilled."""

    @property
    def data(self) -> bytes:
        """The data in one piece (a copy unless it was written in one)."""
        if len(self.parts) == 1 and isinstance(self.parts[0][0], bytes):
            return self.parts[0][0]
        return b"".join(p for p, _ in self.parts)

    @property
    def num_bytes(self) -> int:
        return len(self.header) + sum(len(p) for p, _ in self.parts)


@dataclass(frozen=True, slots=True)
class EntryStat:
    """What ``KVStore.stat`` says about one key."""

    num_bytes: int
    lease_remaining_s: float
    tier: Tier = Tier.RAM
    refs: int = 0


@dataclass(eq=False, slots=True)
class _Entry:
    key: str
    header: bytes
    parts: tuple[Part, ...] | None
    """None while the entry lies on disk."""
    size: int
    expires_at: float
    version: int
    cache: bool
    refs: int = 0
    tier: Tier = Tier.RAM
    live: bool = True
    """False once deleted, replaced or expired; a pinned one frees its bytes at the last unpin."""
    attachment: object | None = None
    """An in-memory object over the entry's own bytes (``PendingPut.commit``): not counted
    apart, so it is dropped when the bytes leave RAM."""

    @property
    def file_name(self) -> str:
        return DiskTier.file_name(self.key, self.version)


@dataclass(frozen=True, slots=True)
class Leases:
    """The lease of a payload: ``default_s`` when its writer asks for none (0), at most
    ``max_s``."""

    default_s: float
    max_s: float

    def __post_init__(self) -> None:
        if not 0 < self.default_s <= self.max_s or math.isinf(self.max_s):
            raise InvalidArgumentError(
                "default_lease_s",
                f"must be in (0, max_lease_s={self.max_s}], got {self.default_s}",
            )

    def of(self, lease_s: float) -> float:
        """The lease a put asking for ``lease_s`` gets."""
        if math.isnan(lease_s) or lease_s < 0:
            raise InvalidArgumentError("lease_s", f"must be >= 0 (0 = default), got {lease_s}")
        return min(lease_s or self.default_s, self.max_s)
