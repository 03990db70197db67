"""The KV store: an in-memory byte store for KV payloads between workers, and its client."""

from __future__ import annotations

from pdserve.kvstore.client import KVStoreClient, PutResult, StoreStat
from pdserve.kvstore.store import EntryStat, KVStore, StoredPayload, StoreStats

__all__ = [
    "EntryStat",
    "KVStore",
    "KVStoreClient",
    "PutResult",
    "StoreStat",
    "StoreStats",
    "StoredPayload",
]
