"""The KV store: a two-tier (RAM, disk) byte store for KV payloads and prefix blocks between
workers, and its client."""

from __future__ import annotations

from pdserve.kvstore.client import KVStoreClient, PutResult, StoreStat
from pdserve.kvstore.stats import StoreStats
from pdserve.kvstore.store import EntryStat, KVStore, PendingPut, ReadHandle, StoredPayload, Tier

__all__ = [
    "EntryStat",
    "KVStore",
    "KVStoreClient",
    "PendingPut",
    "PutResult",
    "ReadHandle",
    "StoreStat",
    "StoreStats",
    "StoredPayload",
    "Tier",
]
