"""``StoreBlocks``: the KV store's prompt-prefix blocks as this worker saw them change.

``PrefixReuse`` logs the blocks of every chunk it put into the store (stored) and of the first
chunk a lookup missed (removed: the store evicted it, or it never was there), and
``worker.kv_events.StoreEventPublisher`` drains the log into the cluster's KV event stream,
where the scheduler's prefix index keeps them under the store's name
(``scheduling.prefix_index.store_id``). So the scheduler learns what any worker put into a
shared store, whichever host computed it. Bounded: past 65,536 events the oldest are dropped
(the index is a hint, and lookups correct it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pdserve.errors import InvalidArgumentError


class StoreBlocks:
    """The log (see the module docstring); used on the event loop only."""

    def __init__(self, address: str, block_size: int) -> None:
        if block_size < 1:
            raise InvalidArgumentError("block_size", f"must be >= 1, got {block_size}")
        self.address = address
        self.block_size = block_size
        self._events: deque[tuple[bool, bytes]] = deque(maxlen=65536)

    def stored(self, hashes: Sequence[bytes]) -> None:
        self._events.extend((True, h) for h in hashes)

    def removed(self, hashes: Sequence[bytes]) -> None:
        self._events.extend((False, h) for h in hashes)

    def drain(self) -> list[tuple[bool, bytes]]:
        """The events since the last drain, oldest first."""
        out = list(self._events)
        self._events.clear()
        return out
