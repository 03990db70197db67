"""KVStore: an in-memory byte store for KV payloads in flight between workers.

A prefill worker puts a payload under a key with a lease; the decode worker reads it back
(usually deleting it as it reads). The lease bounds how long an orphan (a decode that never
came) holds memory: an entry whose lease has run out is gone for every reader at once
(checked lazily on access) and its bytes are reclaimed by ``sweep()``, which the service calls
periodically and which also runs whenever a put needs room.

Not thread-safe: the KVStore service calls it from its one event loop thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import CapacityError, InvalidArgumentError, UnknownRequestError

Clock = Callable[[], float]
"""Seconds on a monotonic clock; injectable so that tests move time instead of sleeping."""


@dataclass(frozen=True, slots=True)
class StoredPayload:
    """One entry: the opaque header and data as written, and when its lease ends."""

    key: str
    header: bytes
    data: bytes
    expires_at: float
    """On the store's clock."""
    version: int
    """Increases with every put, so that a reader can delete exactly what it read."""

    @property
    def num_bytes(self) -> int:
        return len(self.header) + len(self.data)


@dataclass(frozen=True, slots=True)
class EntryStat:
    """What ``KVStore.stat`` says about one key."""

    num_bytes: int
    lease_remaining_s: float


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Totals and counters since the store started."""

    used_bytes: int
    capacity_bytes: int
    num_entries: int
    bytes_in: int
    """Bytes accepted by put."""
    bytes_out: int
    """Bytes handed out by get."""
    hits: int
    misses: int
    """Gets of absent or expired keys."""
    expired: int
    """Entries dropped because their lease ran out."""


class KVStore:
    """Byte payloads under string keys, with a total byte budget and per-entry leases."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        default_lease_s: float = 60.0,
        max_lease_s: float = 3600.0,
        clock: Clock = time.monotonic,
    ) -> None:
        if capacity_bytes < 1:
            raise InvalidArgumentError("capacity_bytes", f"must be >= 1, got {capacity_bytes}")
        if not 0 < default_lease_s <= max_lease_s or math.isinf(max_lease_s):
            raise InvalidArgumentError(
                "default_lease_s",
                f"must be in (0, max_lease_s={max_lease_s}], got {default_lease_s}",
            )
        self.capacity_bytes = capacity_bytes
        self.default_lease_s = default_lease_s
        self.max_lease_s = max_lease_s
        self._clock = clock
        self._entries: dict[str, StoredPayload] = {}
        self._used = 0
        self._version = 0
        self._bytes_in = self._bytes_out = 0
        self._hits = self._misses = self._expired = 0

    # -- writes ----------------------------------------------------------------------------
    def lease_for(self, lease_s: float) -> float:
        """The lease a put asking for ``lease_s`` gets: 0 means the default; capped at max."""
        if math.isnan(lease_s) or lease_s < 0:
            raise InvalidArgumentError("lease_s", f"must be >= 0 (0 = default), got {lease_s}")
        return min(lease_s or self.default_lease_s, self.max_lease_s)

    def check_room(self, num_bytes: int, *, replacing: str | None = None) -> None:
        """Raise ``CapacityError`` unless ``num_bytes`` more would fit (after a sweep).

        ``replacing``: a key whose current entry the new one would replace (its bytes count
        as free).
        """
        if num_bytes > self.capacity_bytes:
            raise CapacityError(
                f"payload of {num_bytes} bytes exceeds the store's capacity {self.capacity_bytes}"
            )
        if self._free_for(num_bytes, replacing) < num_bytes:
            self.sweep()
            free = self._free_for(num_bytes, replacing)
            if free < num_bytes:
                raise CapacityError(
                    f"KV store full: {num_bytes} bytes needed, {free} of {self.capacity_bytes} free"
                )

    def _free_for(self, num_bytes: int, replacing: str | None) -> int:
        old = self._entries.get(replacing) if replacing is not None else None
        return self.capacity_bytes - self._used + (old.num_bytes if old else 0)

    def put(self, key: str, data: bytes, lease_s: float = 0.0, *, header: bytes = b"") -> float:
        """Store ``header`` + ``data`` under ``key`` (replacing any entry); returns the lease."""
        if not key:
            raise InvalidArgumentError("key", "must not be empty")
        lease = self.lease_for(lease_s)
        size = len(header) + len(data)
        self.check_room(size, replacing=key)
        self._drop(key)
        self._version += 1
        self._entries[key] = StoredPayload(
            key, bytes(header), bytes(data), self._clock() + lease, self._version
        )
        self._used += size
        self._bytes_in += size
        return lease

    def delete(self, key: str, *, version: int | None = None) -> bool:
        """Remove ``key``; False if absent. With ``version``, only if the entry is that one."""
        entry = self._live(key)
        if entry is None or (version is not None and entry.version != version):
            return False
        self._drop(key)
        return True

    def sweep(self) -> int:
        """Drop every entry whose lease has run out; returns how many."""
        now = self._clock()
        expired = [k for k, e in self._entries.items() if e.expires_at <= now]
        for key in expired:
            self._drop(key)
        self._expired += len(expired)
        return len(expired)

    # -- reads -----------------------------------------------------------------------------
    def get(self, key: str) -> StoredPayload:
        """The live entry under ``key``; ``UnknownRequestError`` (NOT_FOUND) if absent/expired."""
        entry = self._live(key)
        if entry is None:
            self._misses += 1
            raise UnknownRequestError(f"no KV payload under key {key!r} (absent or expired)")
        self._hits += 1
        self._bytes_out += entry.num_bytes
        return entry

    def stat(self, key: str) -> EntryStat | None:
        """Size and remaining lease of ``key``, or None if absent/expired."""
        entry = self._live(key)
        if entry is None:
            return None
        return EntryStat(entry.num_bytes, max(0.0, entry.expires_at - self._clock()))

    def stats(self) -> StoreStats:
        """Totals (after dropping expired entries) and counters."""
        self.sweep()
        return StoreStats(
            used_bytes=self._used,
            capacity_bytes=self.capacity_bytes,
            num_entries=len(self._entries),
            bytes_in=self._bytes_in,
            bytes_out=self._bytes_out,
            hits=self._hits,
            misses=self._misses,
            expired=self._expired,
        )

    # -- internals -------------------------------------------------------------------------
    def _live(self, key: str) -> StoredPayload | None:
        """The entry if its lease still runs; an expired one is dropped on the way."""
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at <= self._clock():
            self._drop(key)
            self._expired += 1
            return None
        return entry

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._used -= entry.num_bytes
