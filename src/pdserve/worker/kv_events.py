"""Publishes this worker's prefix-cache changes to the cluster's KV event stream.

The engine logs every block hash it stores in or evicts from its prefix cache
(``engine.block_manager.BlockEvents``); ``KVEventPublisher.run`` drains that log every
``INTERVAL_S`` and appends what it found as one entry of the Redis stream ``{ns}:kvevents``
(the format is in ``scheduling.prefix_index``, whose index the scheduler keeps). First, and
then every ``SNAPSHOT_INTERVAL_S`` or when the log overflowed, it sends a full snapshot
instead, taken on the engine thread between two steps so that no event is lost or counted
twice. Redis errors are logged once per outage and the next pass sends a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from redis.asyncio import Redis
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from pdserve.engine.block_manager import BlockEvents
from pdserve.engine.engine import Engine
from pdserve.engine_loop.async_engine import AsyncEngine
from pdserve.prefix.store_blocks import StoreBlocks
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.prefix_index import STORE_EPOCH, encode_events, store_id

logger = logging.getLogger(__name__)

STREAM_MAXLEN = 20_000
"""Entries the stream keeps (approximately): a scheduler that starts later replays these."""
INTERVAL_S = 0.05
"""The publishing period."""
SNAPSHOT_INTERVAL_S = 30.0


def install_events(engine: AsyncEngine) -> BlockEvents:
    """Make the engine log its prefix-cache changes (call before ``engine.start()``)."""
    events = BlockEvents()
    engine.engine.block_manager.events = events
    engine.block_events = events
    return events


class KVEventPublisher:
    """Drains one engine's ``BlockEvents`` into the stream (see the module docstring)."""

    def __init__(
        self,
        redis: Redis,
        keys: KeySpace,
        worker_id: str,
        engine: AsyncEngine,
        events: BlockEvents,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.engine = engine
        self.events = events
        self.epoch = uuid.uuid4().hex.encode()
        self.block_size = engine.layout.block_size
        self.published = 0
        """Stream entries written."""
        self._next_snapshot = 0.0  # monotonic time; 0: the next pass sends one

    async def run(self) -> None:
        """Publish until cancelled."""
        failing = False
        while True:
            try:
                await self.publish_once()
            except (RedisError, OSError) as err:
                if not failing:
                    logger.warning("publishing KV events failed, retrying: %s", err)
                failing = True
                self._next_snapshot = 0.0  # entries may be lost: resynchronise
            else:
                failing = False
            await asyncio.sleep(INTERVAL_S)  # the publishing period, a timer

    async def publish_once(self) -> None:
        """One pass: a snapshot when due, else the events logged since the last pass."""
        now = time.monotonic()
        if now >= self._next_snapshot or self.events.overflowed:
            hashes = await self.engine.call(self._snapshot)
            self._next_snapshot = now + SNAPSHOT_INTERVAL_S
            await self._append(encode_events([(True, h) for h in hashes]), snapshot=True)
            return
        drained = self.events.drain()
        if drained:
            await self._append(encode_events(drained), snapshot=False)

    def _snapshot(self, engine: Engine) -> list[bytes]:
        """On the engine thread: every cached hash, and a fresh log from this point on."""
        self.events.reset()
        return engine.block_manager.cached_hashes()

    async def _append(self, payload: bytes, *, snapshot: bool) -> None:
        fields: dict[FieldT, EncodableT] = {
            "w": self.worker_id,
            "e": self.epoch,
            "b": self.block_size,
            "x": payload,
        }
        if snapshot:
            fields["f"] = b"1"
        await self.redis.xadd(self.keys.kv_events, fields, maxlen=STREAM_MAXLEN, approximate=True)
        self.published += 1


class StoreEventPublisher:
    """Drains a ``StoreBlocks`` log (the KV store's prefix blocks this worker put or found
    gone) into the stream under the store's name, every ``INTERVAL_S``; no snapshots (the
    store's content is the sum of every worker's entries, all of one epoch)."""

    def __init__(self, redis: Redis, keys: KeySpace, blocks: StoreBlocks) -> None:
        self.redis = redis
        self.keys = keys
        self.blocks = blocks
        self.published = 0

    async def run(self) -> None:
        """Publish until cancelled; an outage loses the events it spans (a hint)."""
        failing = False
        while True:
            events = self.blocks.drain()
            if events:
                fields: dict[FieldT, EncodableT] = {
                    "w": store_id(self.blocks.address),
                    "e": STORE_EPOCH,
                    "b": self.blocks.block_size,
                    "x": encode_events(events),
                }
                try:
                    await self.redis.xadd(
                        self.keys.kv_events, fields, maxlen=STREAM_MAXLEN, approximate=True
                    )
                    self.published += 1
                    failing = False
                except (RedisError, OSError) as err:
                    if not failing:
                        logger.warning("publishing the KV store's blocks failed: %s", err)
                    failing = True
            await asyncio.sleep(INTERVAL_S)  # the publishing period, a timer
