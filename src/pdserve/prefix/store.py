"""Prefix reuse across prefill workers through the KV store.

A prompt's KV is cut into chunks of ``chunk_tokens`` tokens (a multiple of the engine's block
size; 256 by default). Chunk ``i`` is stored under::

    pfx/{kv fingerprint}/{chained hash of the chunk's last block}   (kvstore.keys)

the hash being ``block_manager.chain_block_hashes(prompt, block_size, salt=tenant)``. A chained
hash covers every token before it and the tenant, so equal keys mean equal prefixes of one
tenant: tenants never share a chunk. Chunks are cache entries in the store (``cache=True``:
droppable, spilled to disk under pressure, expiring after ``lease_s``), each a
``KVPayload.to_bytes()`` of its tokens (self-describing, CRC-checked).

For one request:

1. ``seed``: ask the store how many leading chunks it holds (``Lookup``), fetch them, and
   import them into this engine's prefix cache: a throw-away request with the prefix as its
   prompt, the fetched KV as its payload and ``max_tokens=1`` finishes on import and leaves the
   blocks cached. The request itself, added next, then computes only the rest (its
   ``num_cached_tokens`` counts the imported tokens). The last prompt token is never part of a
   chunk: the engine must compute at least one token to sample from.
2. ``publisher``: a layer hook that copies the chunks the store did not have, and ``publish``
   puts them into the store in the background (tracked; ``close`` waits for it).

With ``store_blocks`` (a ``StoreBlocks`` log) the blocks of each chunk put are logged as
stored, and those of the first chunk a lookup missed as removed: the worker publishes them to
the scheduler's prefix index, which so learns what the store holds (``prefix.store_blocks``).

A worker whose own prefix cache already holds the prefix still fetches it; the import then
costs one copy and changes nothing. Failures of the store only lose the reuse: they are
logged, and the request computes its whole prompt.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING

import numpy as np

from pdserve.backends import EngineBackend
from pdserve.engine.block_manager import chain_block_hashes
from pdserve.engine.kv_arrays import concat, host_copy
from pdserve.engine.kv_payload import KVLayout, KVPayload, kv_fingerprint
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError, PdServeError
from pdserve.kvstore.backend import StoreClient
from pdserve.kvstore.keys import prefix_chunk_key
from pdserve.prefix.store_blocks import StoreBlocks

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

logger = logging.getLogger(__name__)


class ChunkPublisher:
    """A layer hook keeping the prompt's chunks ``[first, last)`` (copies; views die).
    ``blocks``: each chunk's block hashes."""

    def __init__(
        self, keys: list[str], first: int, chunk_tokens: int, blocks: list[list[bytes]]
    ) -> None:
        self.keys = keys
        self.blocks = blocks
        self.first = first
        self.chunk_tokens = chunk_tokens
        self.keys_out: dict[int, np.ndarray] = {}
        self.values_out: dict[int, np.ndarray] = {}
        self.error: Exception | None = None

    def __call__(self, layer: int, k: KVArray, v: KVArray) -> None:
        try:
            lo, hi = self.first * self.chunk_tokens, len(self.keys) * self.chunk_tokens
            self.keys_out[layer] = host_copy(k[lo:hi])
            self.values_out[layer] = host_copy(v[lo:hi])
        except Exception as err:  # a hook never raises into the engine
            self.error = err


class PrefixReuse:
    """Fetches and publishes prompt-prefix chunks (see the module docstring)."""

    def __init__(
        self,
        store: StoreClient,
        layout: KVLayout,
        *,
        chunk_tokens: int = 256,
        lease_s: float = 600.0,
        store_blocks: StoreBlocks | None = None,
    ) -> None:
        if chunk_tokens < layout.block_size or chunk_tokens % layout.block_size:
            raise InvalidArgumentError(
                "prefix_chunk_tokens",
                f"must be a multiple of the block size {layout.block_size}, got {chunk_tokens}",
            )
        self.store = store
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.lease_s = lease_s
        self.store_blocks = store_blocks
        self.fingerprint = kv_fingerprint(layout)
        self._tasks: set[asyncio.Task[None]] = set()

    def chunk_blocks(self, prompt_ids: Sequence[int], tenant: str) -> list[list[bytes]]:
        """The block hashes of each of the prompt's whole chunks (the last token never in one)."""
        n_chunks = (len(prompt_ids) - 1) // self.chunk_tokens
        if n_chunks <= 0:
            return []
        bs = self.layout.block_size
        hashes = chain_block_hashes(prompt_ids[: n_chunks * self.chunk_tokens], bs, salt=tenant)
        per = self.chunk_tokens // bs
        return [hashes[i * per : (i + 1) * per] for i in range(n_chunks)]

    def keys(self, prompt_ids: Sequence[int], tenant: str) -> list[str]:
        """The store keys of the prompt's whole chunks: each its last block's hash."""
        return [
            prefix_chunk_key(self.fingerprint, c[-1]) for c in self.chunk_blocks(prompt_ids, tenant)
        ]

    async def seed(
        self, engine: EngineBackend, request_id: str, prompt_ids: Sequence[int], tenant: str
    ) -> int:
        """Import the leading chunks the store holds into the engine; returns how many."""
        chunks = self.chunk_blocks(prompt_ids, tenant)
        keys = [prefix_chunk_key(self.fingerprint, c[-1]) for c in chunks]
        if not keys:
            return 0
        try:
            found = await self.store.lookup(keys)
            if found < len(keys) and self.store_blocks is not None:
                self.store_blocks.removed(chunks[found])  # the index may believe otherwise
            if not found:
                return 0
            blobs = await asyncio.gather(*(self.store.get(k) for k in keys[:found]))
            payload = await asyncio.to_thread(self._join, blobs)
        except PdServeError as err:
            logger.warning(
                "%s: prefix fetch failed (%s); computing the whole prompt", request_id, err
            )
            return 0
        n = payload.num_tokens
        # The throw-away request: its payload lands in the engine's blocks, it finishes on
        # import (max_tokens=1, its "first token" is the prompt's next one) and its blocks stay
        # cached under the prefix's hashes.
        prefix = EngineRequest(
            f"{request_id}#prefix",
            tuple(prompt_ids[:n]),
            SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
            tenant=tenant,
        )
        stream = engine.decode(prefix, (int(prompt_ids[n]), 0.0), payload)
        async with aclosing(stream):
            async for _ in stream:
                pass
        return found

    def _join(self, blobs: Sequence[bytes]) -> KVPayload:
        chunks = [KVPayload.from_bytes(b) for b in blobs]
        for c in chunks:
            self.layout.check_compatible(c.layout)
        n = self.layout.num_layers
        return KVPayload(
            self.layout,
            sum(c.num_tokens for c in chunks),
            tuple(concat([c.keys[i] for c in chunks]) for i in range(n)),
            tuple(concat([c.values[i] for c in chunks]) for i in range(n)),
        )

    def publisher(
        self, prompt_ids: Sequence[int], tenant: str, *, first: int
    ) -> ChunkPublisher | None:
        """A layer hook for the chunks from ``first`` on (the store lacks them); None if none."""
        chunks = self.chunk_blocks(prompt_ids, tenant)
        if first >= len(chunks):
            return None
        keys = [prefix_chunk_key(self.fingerprint, c[-1]) for c in chunks]
        return ChunkPublisher(keys, first, self.chunk_tokens, chunks)

    def publish(self, publisher: ChunkPublisher) -> None:
        """Put the publisher's chunks into the store, in the background (tracked)."""
        if publisher.error is not None or len(publisher.keys_out) != self.layout.num_layers:
            logger.warning("prefix chunks not published: %s", publisher.error or "layers missing")
            return
        task = asyncio.get_running_loop().create_task(self._put(publisher), name="prefix-publish")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def _put(self, p: ChunkPublisher) -> None:
        ct, n = self.chunk_tokens, self.layout.num_layers
        for i in range(p.first, len(p.keys)):
            lo = (i - p.first) * ct
            chunk = KVPayload(
                self.layout,
                ct,
                tuple(p.keys_out[layer][lo : lo + ct] for layer in range(n)),
                tuple(p.values_out[layer][lo : lo + ct] for layer in range(n)),
            )
            blob = await asyncio.to_thread(chunk.to_bytes)
            await self.store.put(p.keys[i], blob, self.lease_s, cache=True)
            if self.store_blocks is not None:
                self.store_blocks.stored(p.blocks[i])

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        err = task.exception()
        if err is not None:
            logger.warning("publishing prefix chunks failed: %s", err)

    async def close(self) -> None:
        """Wait for publishing still in progress."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
