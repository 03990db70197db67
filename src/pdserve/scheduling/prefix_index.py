"""Which worker caches which KV blocks: an index fed by the workers' prefix-cache events.

Workers publish every change of their prefix cache (a block's chained hash stored or evicted,
``engine.block_manager.BlockEvents``) to one Redis stream, ``{ns}:kvevents``, in batches
(``worker.kv_events``); the scheduler follows the stream (``XREAD BLOCK``: pushed to it, not
polled from the workers) and keeps, per worker, the set of hashes it holds. A request's
prompt is hashed the way the engines hash it (``chain_block_hashes``: the block size, the
tenant as salt); the number of leading hashes a worker holds is how many of the prompt's
tokens it would not have to compute (``cached_tokens``).

Stream entries (all fields bytes)::

    w  worker id          e  the worker process's epoch (a random id per start)
    b  block size         f  b"1": a full snapshot, replacing what was known of the worker
    x  events: 17-byte records, one kind byte (b"+" stored, b"-" removed) and a 16-byte hash

A worker starts with a snapshot and sends another every so often, so a scheduler that starts
later, or missed entries trimmed from the stream, converges. An entry of a new epoch replaces
everything known of that worker (it restarted with an empty cache). The index is a hint: a
block may be evicted right after it was counted; the worker's engine decides what it reuses.

A KV store is indexed too, under ``store_id(address)``: the workers that share prompt-prefix
chunks through it (``--prefix-reuse``) publish the blocks of each chunk they put (stored) and
of the first chunk a lookup missed (removed: evicted), all with the one epoch
``STORE_EPOCH`` so that their entries add up. A worker whose heartbeat names the store it
fetches prefixes from (``WorkerInfo.prefix_store``) can reuse what any host put there:
``PromptBlocks.reusable_tokens`` counts the longer of its own cache's prefix and the store's.
Store entries are never forgotten with the heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import cast

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.engine.block_manager import chain_block_hashes
from pdserve.scheduling.keys import KeySpace, text
from pdserve.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

HASH_BYTES = 16
"""Length of a chained block hash (``chain_block_hashes`` digests)."""
RECORD_BYTES = 1 + HASH_BYTES
STORED, REMOVED = b"+", b"-"
STORE_PREFIX = "kvstore:"
STORE_EPOCH = b"store"
"""The epoch of every store entry: one for all its publishers, so that theirs add up."""


def store_id(address: str) -> str:
    """The index's name for the KV store at ``address`` (see the module docstring)."""
    return f"{STORE_PREFIX}{address}"


def encode_events(events: Sequence[tuple[bool, bytes]]) -> bytes:
    """``(stored, hash)`` events as the ``x`` field of a stream entry."""
    return b"".join((STORED if stored else REMOVED) + h for stored, h in events)


def decode_events(raw: bytes) -> list[tuple[bool, bytes]]:
    """Inverse of ``encode_events``; a truncated tail is ignored."""
    n = len(raw) // RECORD_BYTES
    return [
        (raw[i * RECORD_BYTES : i * RECORD_BYTES + 1] == STORED,
         raw[i * RECORD_BYTES + 1 : (i + 1) * RECORD_BYTES])
        for i in range(n)
    ]  # fmt: skip


@dataclass(slots=True)
class _Worker:
    epoch: bytes
    block_size: int
    hashes: set[bytes] = field(default_factory=set)


class PrefixIndex:
    """Per worker, the hashes of the blocks its prefix cache holds (see the module docstring)."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}
        self.entries = 0
        """Stream entries applied."""

    def apply(
        self,
        worker_id: str,
        epoch: bytes,
        block_size: int,
        events: Sequence[tuple[bool, bytes]],
        *,
        snapshot: bool = False,
    ) -> None:
        """Fold one stream entry into the index."""
        known = self._workers.get(worker_id)
        if snapshot or known is None or known.epoch != epoch or known.block_size != block_size:
            known = self._workers[worker_id] = _Worker(epoch, block_size)
        hashes = known.hashes
        for stored, h in events:
            if stored:
                hashes.add(h)
            else:
                hashes.discard(h)
        self.entries += 1

    def forget(self, keep: Sequence[str]) -> None:
        """Drop every worker not in ``keep`` (their heartbeats expired); stores stay."""
        for worker_id in set(self._workers) - set(keep):
            if not worker_id.startswith(STORE_PREFIX):
                del self._workers[worker_id]

    def block_size(self, worker_id: str) -> int | None:
        """The block size the worker's hashes are made with; None if nothing is known."""
        known = self._workers.get(worker_id)
        return None if known is None else known.block_size

    def leading_blocks(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first on, the worker holds."""
        known = self._workers.get(worker_id)
        if known is None:
            return 0
        held = known.hashes
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def size(self, worker_id: str) -> int:
        known = self._workers.get(worker_id)
        return 0 if known is None else len(known.hashes)


class PromptBlocks:
    """A prompt's chained block hashes, made once per block size it is asked for."""

    def __init__(self, token_ids: Sequence[int], salt: str) -> None:
        self.token_ids = token_ids
        self.salt = salt
        self._by_size: dict[int, list[bytes]] = {}

    def hashes(self, block_size: int) -> list[bytes]:
        """The hashes of the prompt's full blocks, but the last token's (the engine always
        computes that one: it needs its logits)."""
        found = self._by_size.get(block_size)
        if found is None:
            usable = max(0, len(self.token_ids) - 1)
            found = chain_block_hashes(self.token_ids[:usable], block_size, salt=self.salt)
            self._by_size[block_size] = found
        return found

    def cached_tokens(self, index: PrefixIndex, worker_id: str) -> int:
        """Prompt tokens ``worker_id`` holds the KV of, by the index."""
        block_size = index.block_size(worker_id)
        if block_size is None or not self.token_ids:
            return 0
        return index.leading_blocks(worker_id, self.hashes(block_size)) * block_size

    def reusable_tokens(self, index: PrefixIndex, worker_id: str, prefix_store: str) -> int:
        """Prompt tokens ``worker_id`` need not compute: its own cache's prefix, or the one
        the store it fetches prefixes from (``prefix_store``; empty: none) holds."""
        own = self.cached_tokens(index, worker_id)
        return max(own, self.cached_tokens(index, store_id(prefix_store))) if prefix_store else own


async def follow_events(index: PrefixIndex, redis: Redis, keys: KeySpace) -> None:
    """Apply the stream's entries to ``index`` as they come, from the oldest retained on,
    until cancelled. A Redis outage is logged once; reading resumes where it stopped."""
    last_id: bytes | str = "0"
    failing = False
    while True:
        try:
            replies = await redis.xread({keys.kv_events: last_id}, block=1000, count=512)
        except (RedisError, OSError) as err:
            if not failing:
                logger.warning("reading KV events failed, retrying: %s", err)
            failing = True
            await asyncio.sleep(1.0)  # a retry timer, not synchronisation
            continue
        failing = False
        for _stream, entries in cast(list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]],
                                     replies or []):  # fmt: skip
            for entry_id, fields in entries:
                last_id = entry_id
                _apply_entry(index, fields)


def _apply_entry(index: PrefixIndex, fields: dict[bytes, bytes]) -> None:
    try:
        worker_id = text(fields[b"w"])
        block_size = int(fields[b"b"])
        epoch = fields[b"e"]
    except (KeyError, ValueError) as err:
        logger.error("ignoring a malformed KV event entry: %r", err)
        return
    events = decode_events(fields.get(b"x", b""))
    index.apply(worker_id, epoch, block_size, events, snapshot=fields.get(b"f") == b"1")


@contextlib.asynccontextmanager
async def following(index: PrefixIndex, redis: Redis, keys: KeySpace) -> AsyncIterator[None]:
    """Keep ``index`` following the stream while inside (one task, cancelled on exit)."""
    task = asyncio.create_task(follow_events(index, redis, keys), name="kv-events-follow")
    try:
        yield
    finally:
        await cancel_and_wait(task)
