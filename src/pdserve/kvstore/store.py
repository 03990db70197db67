"""KVStore: a two-tier byte store for KV payloads and KV blocks in flight between workers.

Entries are opaque ``header + data`` under string keys (their namespaces: ``kvstore.keys``).
Two kinds share the store:

* hand-offs (``kv/{request_id}/{capability}``): a prefill worker writes one, usually layer by
  layer while it computes (``begin_put`` -> ``append``... -> ``commit``), and the decode
  worker reads it once, deleting it as it reads;
* cache entries (``cache=True``, prefix blocks keyed by their chained content hash): written
  once, read by any prefill of a prompt with the same prefix, and droppable.

Every entry has a lease: one whose reader never comes expires (checked lazily on access, and
by ``sweep()``, which the service runs periodically and which also runs when room is short).

Tiers. RAM holds at most ``capacity_bytes`` (entries plus the room reserved by writes in
progress). When a write or a reload needs room, the least recently used entries that nobody is
reading or writing (unpinned, ``refs == 0``) move to the disk tier, which has its own budget;
reading a spilled entry brings it back into RAM. When the disk is full too, the least recently
used cache entries are dropped (evictions); hand-offs are never dropped to make room. If
nothing can give way (everything pinned, or only hand-offs left and no disk room), the write
fails with ``CapacityError`` (RESOURCE_EXHAUSTED), never a process out of memory.

Ref counts (``refs``): each open read (``open_read``) and the write of an entry pin it in RAM.
An entry deleted, replaced or expired while pinned disappears for new readers at once and
gives its bytes back when the last reader lets go.

Not thread-safe: the KVStore service calls it from its one event-loop thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from pdserve.errors import (
    CapacityError,
    InvalidArgumentError,
    UnknownRequestError,
)
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.entry import EntryStat, Leases, Part, StoredPayload, Tier, _Entry
from pdserve.kvstore.handles import PendingPut, ReadHandle
from pdserve.kvstore.room import Action, plan_room
from pdserve.kvstore.stats import StoreStats

__all__ = ["EntryStat", "KVStore", "Part", "PendingPut", "ReadHandle", "StoredPayload", "Tier"]

Clock = Callable[[], float]
"""Seconds on a monotonic clock; injectable so that tests move time instead of sleeping."""


class KVStore:
    """Payloads under string keys: RAM tier, optional disk tier, leases and pins."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        disk_dir: Path | None = None,
        disk_bytes: int = 0,
        default_lease_s: float = 60.0,
        max_lease_s: float = 3600.0,
        clock: Clock = time.monotonic,
    ) -> None:
        if capacity_bytes < 1:
            raise InvalidArgumentError("capacity_bytes", f"must be >= 1, got {capacity_bytes}")
        self.leases = Leases(default_lease_s, max_lease_s)
        if disk_dir is not None and disk_bytes < 1:
            raise InvalidArgumentError("disk_bytes", "a disk tier needs a budget >= 1")
        self.capacity_bytes = capacity_bytes
        self._clock = clock
        self._started = clock()
        self._disk = DiskTier(disk_dir, disk_bytes) if disk_dir is not None else None
        # Live entries, least recently used first (both tiers).
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._writes: set[PendingPut] = set()
        self._write_watchers: dict[str, list[Callable[[PendingPut], None]]] = {}
        self._ram_used = 0
        """RAM entries (live, or dead but still pinned) plus reservations of writes."""
        self._reserved = 0
        self._version = 0
        self._bytes_in = self._bytes_out = 0
        self._hits = self._misses = self._expired = 0
        self._spills = self._reloads = self._evictions = 0
        self._lookups = self._lookup_hits = 0

    def close(self) -> None:
        """Remove the disk tier's directory."""
        if self._disk is not None:
            self._disk.close()

    # -- writes ----------------------------------------------------------------------------
    def begin_put(
        self,
        key: str,
        *,
        header: bytes = b"",
        lease_s: float = 0.0,
        total_bytes: int = 0,
        cache: bool = False,
    ) -> PendingPut:
        """Start a write; ``total_bytes`` (header + data, 0 = unknown) is reserved at once."""
        if not key:
            raise InvalidArgumentError("key", "must not be empty")
        if total_bytes < 0:
            raise InvalidArgumentError("total_bytes", f"must be >= 0, got {total_bytes}")
        lease = self.leases.of(lease_s)
        write = PendingPut(
            self, key, bytes(header), lease, total_bytes, cache, self._clock() + lease
        )
        self._reserve(write, max(total_bytes, len(header)))
        self._writes.add(write)
        for callback in self._write_watchers.pop(key, []):
            callback(write)
        return write

    def watch_writes(self, key: str, callback: Callable[[PendingPut], None]) -> Callable[[], None]:
        """Call ``callback`` once with the next write that begins under ``key`` (a follower
        that came before its writer); returns the function that stops it."""
        self._write_watchers.setdefault(key, []).append(callback)

        def stop() -> None:
            watchers = self._write_watchers.get(key, [])
            if callback in watchers:
                watchers.remove(callback)
            if not watchers:
                self._write_watchers.pop(key, None)

        return stop

    def put(
        self,
        key: str,
        data: bytes,
        lease_s: float = 0.0,
        *,
        header: bytes = b"",
        cache: bool = False,
    ) -> float:
        """Store ``header`` + ``data`` under ``key`` (replacing any entry); returns the lease."""
        write = self.begin_put(
            key, header=header, lease_s=lease_s, total_bytes=len(header) + len(data), cache=cache
        )
        try:
            write.append(bytes(data))
            return write.commit()
        finally:
            write.abort()  # no-op after a commit

    def delete(self, key: str, *, version: int | None = None) -> bool:
        """Remove ``key``; False if absent. With ``version``, only if the entry is that one."""
        entry = self._live(key)
        if entry is None or (version is not None and entry.version != version):
            return False
        self._drop(entry)
        return True

    def sweep(self) -> int:
        """Drop expired entries and abort writes past their lease; returns entries dropped."""
        now = self._clock()
        expired = [e for e in self._entries.values() if e.expires_at <= now]
        for entry in expired:
            self._drop(entry)
        self._expired += len(expired)
        for write in [w for w in self._writes if w.deadline <= now]:
            write.abort("its lease ran out before it was committed")
        return len(expired)

    def pending_write(self, key: str) -> PendingPut | None:
        """The write in progress under ``key``, if any (what a follower reads)."""
        return next((w for w in self._writes if w.key == key), None)

    # -- reads -----------------------------------------------------------------------------
    def open_read(self, key: str) -> ReadHandle:
        """Pin and return the live entry under ``key`` (reloaded into RAM if it was spilled).

        ``UnknownRequestError`` (NOT_FOUND) if absent or expired; ``CapacityError`` if it lies
        on disk and RAM cannot make room for it.
        """
        entry = self._live(key)
        if entry is None:
            self._misses += 1
            raise UnknownRequestError(f"no KV payload under key {key!r} (absent or expired)")
        if entry.tier is Tier.DISK:
            self._reload(entry)
        assert entry.parts is not None  # in RAM now
        entry.refs += 1
        self._entries.move_to_end(key)
        self._hits += 1
        self._bytes_out += entry.size
        payload = StoredPayload(
            key, entry.header, entry.parts, entry.expires_at, entry.version, entry.attachment
        )
        return ReadHandle(self, entry, payload)

    def get(self, key: str) -> StoredPayload:
        """Read ``key`` without keeping it pinned (see ``open_read``)."""
        handle = self.open_read(key)
        handle.close()
        return handle.payload

    def lookup(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first on, are present (a prefix-cache probe).

        The ones found count as used (they move to the recent end of the LRU order).
        """
        found = 0
        for key in keys:
            entry = self._live(key)
            if entry is None:
                break
            self._entries.move_to_end(key)
            found += 1
        self._lookups += len(keys)
        self._lookup_hits += found
        return found

    def stat(self, key: str) -> EntryStat | None:
        """Size, remaining lease, tier and pins of ``key``, or None if absent/expired."""
        entry = self._live(key)
        if entry is None:
            return None
        left = max(0.0, entry.expires_at - self._clock())
        return EntryStat(entry.size, left, entry.tier, entry.refs)

    def keys(self) -> list[str]:
        """Live keys, least recently used first."""
        self.sweep()
        return list(self._entries)

    def stats(self) -> StoreStats:
        """Totals (after dropping expired entries) and counters."""
        self.sweep()
        disk = self._disk
        entries = self._entries.values()
        return StoreStats(
            used_bytes=self._ram_used,
            capacity_bytes=self.capacity_bytes,
            num_entries=len(self._entries),
            bytes_in=self._bytes_in,
            bytes_out=self._bytes_out,
            hits=self._hits,
            misses=self._misses,
            expired=self._expired,
            disk_used_bytes=disk.used_bytes if disk else 0,
            disk_capacity_bytes=disk.capacity_bytes if disk else 0,
            num_disk_entries=sum(1 for e in entries if e.tier is Tier.DISK),
            num_pinned=sum(1 for e in entries if e.refs),
            num_writing=len(self._writes),
            reserved_bytes=self._reserved,
            spills=self._spills,
            reloads=self._reloads,
            evictions=self._evictions,
            lookups=self._lookups,
            lookup_hits=self._lookup_hits,
            uptime_s=self._clock() - self._started,
            num_cache_entries=sum(1 for e in entries if e.cache),
        )

    # -- internals: entries ----------------------------------------------------------------
    def _live(self, key: str) -> _Entry | None:
        """The entry if its lease still runs; an expired one is dropped on the way."""
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at <= self._clock():
            self._drop(entry)
            self._expired += 1
            return None
        return entry

    def _drop(self, entry: _Entry) -> None:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        if not entry.live:
            return
        entry.live = False
        if entry.tier is Tier.DISK:
            if self._disk is not None:
                self._disk.delete(entry.file_name)
        elif entry.refs == 0:
            self._ram_used -= entry.size
        if entry.refs == 0:
            entry.parts = entry.attachment = None

    def _unpin(self, entry: _Entry) -> None:
        entry.refs -= 1
        if entry.refs == 0 and not entry.live:
            self._ram_used -= entry.size
            entry.parts = entry.attachment = None

    def _commit(
        self, write: PendingPut, parts: tuple[Part, ...], attachment: object | None
    ) -> float:
        self._writes.discard(write)
        old = self._entries.get(write.key)
        if old is not None:
            self._drop(old)
        self._ram_used -= write.reserved
        self._reserved -= write.reserved
        self._version += 1
        size = len(write.header) + sum(len(p) for p, _ in parts)
        entry = _Entry(
            write.key,
            write.header,
            parts,
            size,
            self._clock() + write.lease_s,
            self._version,
            write.cache,
            attachment=attachment,
        )
        self._entries[write.key] = entry
        self._ram_used += size
        self._bytes_in += size
        write.reserved = 0
        write.version = entry.version
        return write.lease_s

    def _end_write(self, write: PendingPut) -> None:
        self._writes.discard(write)
        self._ram_used -= write.reserved
        self._reserved -= write.reserved
        write.reserved = 0

    # -- internals: room -------------------------------------------------------------------
    def _reserve(self, write: PendingPut, num_bytes: int) -> None:
        old = self._entries.get(write.key)
        replacing = old if old is not None and old.refs == 0 and old.tier is Tier.RAM else None
        self._make_room(num_bytes, replacing=replacing)
        self._ram_used += num_bytes
        self._reserved += num_bytes
        write.reserved += num_bytes

    def _make_room(
        self, num_bytes: int, *, replacing: _Entry | None = None, keep: _Entry | None = None
    ) -> None:
        """Spill (or drop) unpinned LRU entries until ``num_bytes`` more fit in RAM.

        ``replacing``: an entry the write will replace (its bytes count as free, it is not
        moved). ``keep``: the spilled entry being reloaded (never dropped; its file is deleted
        first, so others may spill into its room). Nothing changes unless all of it fits.
        """
        if num_bytes > self.capacity_bytes:
            raise CapacityError(
                f"payload of {num_bytes} bytes exceeds the store's RAM budget {self.capacity_bytes}"
            )
        plan = self._plan_room(num_bytes, replacing, keep)
        if plan is None:
            self.sweep()  # expired entries give their room back
            plan = self._plan_room(num_bytes, replacing, keep)
        if plan is None:
            free = self.capacity_bytes - self._ram_used
            raise CapacityError(
                f"KV store full: {num_bytes} bytes needed, {free} of {self.capacity_bytes} "
                "free in RAM and nothing left to spill or evict (entries pinned by reads or "
                "writes, or hand-offs with no disk room)"
            )
        if keep is not None and self._disk is not None:
            self._disk.delete(keep.file_name)  # its data is in memory already
        for action, entry in plan:
            if action == "spill":
                self._spill(entry)
            else:
                self._drop(entry)
                self._evictions += 1

    def _plan_room(
        self, num_bytes: int, replacing: _Entry | None, keep: _Entry | None
    ) -> list[tuple[Action, _Entry]] | None:
        """The spills and drops that make ``num_bytes`` fit, LRU first; None if none do."""
        bonus = replacing.size if replacing is not None and replacing.live else 0
        need = self._ram_used - bonus + num_bytes - self.capacity_bytes
        return plan_room(self._entries.values(), need, self._disk, replacing, keep)

    def _spill(self, entry: _Entry) -> None:
        assert self._disk is not None and entry.parts is not None  # planned by _plan_room
        self._disk.write(entry.file_name, entry.header, [p for p, _ in entry.parts])
        entry.parts = None
        entry.attachment = None
        entry.tier = Tier.DISK
        self._ram_used -= entry.size
        self._spills += 1

    def _reload(self, entry: _Entry) -> None:
        assert self._disk is not None  # only spilled entries lie on disk
        header, data = self._disk.read(entry.file_name, len(entry.header))
        self._make_room(entry.size, keep=entry)  # deletes the file once room is certain
        entry.header, entry.parts, entry.tier = header, ((data, None),), Tier.RAM
        self._ram_used += entry.size
        self._reloads += 1
