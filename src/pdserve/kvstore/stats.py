"""What the KV store reports about itself (``KVStore.stats``, the ``Stat`` RPC with no key)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Totals now, and counters since the store started."""

    used_bytes: int
    """RAM tier: bytes of the entries held there plus the room reserved by writes."""
    capacity_bytes: int
    """RAM tier budget."""
    num_entries: int
    """Live entries, both tiers."""
    bytes_in: int
    """Bytes committed by writes."""
    bytes_out: int
    """Bytes handed to readers."""
    hits: int
    misses: int
    """Reads of absent or expired keys."""
    expired: int
    """Entries dropped because their lease ran out."""
    disk_used_bytes: int = 0
    disk_capacity_bytes: int = 0
    """0: no disk tier."""
    num_disk_entries: int = 0
    num_pinned: int = 0
    """Entries being read right now."""
    num_writing: int = 0
    """Writes begun and not yet committed or aborted."""
    reserved_bytes: int = 0
    """Part of ``used_bytes`` reserved by those writes."""
    spills: int = 0
    """Entries moved from RAM to disk to make room."""
    reloads: int = 0
    """Spilled entries brought back into RAM by a read."""
    evictions: int = 0
    """Cache entries dropped to make room."""
    lookups: int = 0
    """Keys asked about by prefix probes (``lookup``)."""
    lookup_hits: int = 0
    """Of those, keys found."""
    uptime_s: float = 0.0
    num_cache_entries: int = 0
    """Of ``num_entries``, cache entries (prefix blocks); the others are hand-offs."""

    @property
    def hit_rate(self) -> float:
        """Reads that found their key, over all reads (0 before the first read)."""
        reads = self.hits + self.misses
        return self.hits / reads if reads else 0.0


@dataclass(frozen=True, slots=True)
class StoreStat:
    """``Stat`` of one key (``exists``, ``num_bytes``, ``lease_remaining_s``, ``tier``,
    ``refs``) or the totals (``used_bytes``, ``capacity_bytes``, ``num_entries``, ``totals``),
    as a client reads it."""

    exists: bool
    num_bytes: int
    lease_remaining_s: float
    used_bytes: int
    capacity_bytes: int
    num_entries: int
    tier: str = ""
    refs: int = 0
    totals: StoreStats | None = None
    """Every total and counter; None for a key's stat."""
