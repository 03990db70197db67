"""What a decode worker's inbox still holds (``Decode.InboxStat``): the leak checks' view of
``direct`` hand-offs, as ``KVStore.Stat`` is the KV store's. Lives in ``bench.faults.leaks``."""

from __future__ import annotations

from pdserve_bench.faults.leaks import inbox_held

__all__ = ["inbox_held"]
