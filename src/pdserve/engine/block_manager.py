"""Paged KV memory: ref-counted fixed-size blocks, a free list, and prefix caching.

A block is identified for reuse by a *chained* hash: hash(parent block's hash, its tokens,
salt). Two blocks with equal hashes therefore hold the KV of identical token prefixes, so a
block is only ever reused when every token before it matches too. The salt (a tenant, say)
keeps prefixes of different tenants apart.

Freed blocks keep their hash and stay findable until the block is handed out again; the free
list is LRU, so the least recently freed cached block is the first to be overwritten.

With ``events`` set, every hash that enters or leaves the prefix cache is logged there in
order (``BlockEvents``), for a publisher on another thread: a cluster scheduler keeps an
index of which worker caches which blocks from these events.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence

BLOCK_HASH_BYTES = 16
"""Length of a chained block hash (``chain_block_hashes``)."""


def chain_block_hashes(
    token_ids: Seq[int], block_size: int, *, salt: str = "", parent: bytes = b"", start: int = 0
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids[start*block_size:]``.

    ``parent`` is the hash of block ``start - 1`` (empty for the first block). Stable across
    processes and hosts, so the KV store can key blocks by it too.
    """
    out: list[bytes] = []
    salt_bytes = salt.encode()
    for i in range(start, len(token_ids) // block_size):
        h = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES)
        h.update(parent)
        h.update(salt_bytes)
        h.update(
            b"".join(
                t.to_bytes(4, "little") for t in token_ids[i * block_size : (i + 1) * block_size]
            )
        )
        parent = h.digest()
        out.append(parent)
    return out


class BlockEvents:
    """Prefix-cache changes in order: ``(True, hash)`` stored, ``(False, hash)`` removed.

    Appended by the engine thread, drained by a publisher on another (``deque`` appends and
    pops are atomic). Bounded: past ``capacity`` undrained events the log stops recording and
    sets ``overflowed``, and the publisher sends a full snapshot instead.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self.overflowed = False
        self._log: deque[tuple[bool, bytes]] = deque()

    def record(self, stored: bool, block_hash: bytes) -> None:
        if len(self._log) >= self.capacity:
            self.overflowed = True
            return
        self._log.append((stored, block_hash))

    def drain(self) -> list[tuple[bool, bytes]]:
        """The events recorded so far, oldest first, removed from the log."""
        out: list[tuple[bool, bytes]] = []
        while True:
            try:
                out.append(self._log.popleft())
            except IndexError:
                return out

    def reset(self) -> None:
        """Forget everything recorded (a snapshot has just been taken on the engine thread)."""
        self._log.clear()
        self.overflowed = False


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    """Owns the block pool's bookkeeping. Never touches tensors."""

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = []
        """The blocks handed out so far, by id: a pool's blocks are made as it first hands
        them out, lowest id first (a modelled pool has 10^4-10^5 blocks that an idle worker
        need not hold)."""
        # Handed-out blocks at ref_count == 0, least recently freed first (never handed-out
        # ones come before them all). Values unused (OrderedDict as a set).
        self._free: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.events: BlockEvents | None = None
        """Where cache changes are logged (set before the engine runs); None: nowhere."""

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - len(self.blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that ``seq`` can hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- prefix cache ---------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq`` (no refs taken).

        Leaves at least one prompt token uncomputed: the engine needs its logits to sample.
        """
        if not self.enable_prefix_caching:
            return []
        n_full = (len(seq) - 1) // self.block_size
        self._hash_blocks(seq, n_full)
        hits: list[int] = []
        for h in seq.block_hashes[:n_full]:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        self.prefix_queries += n_full
        self.prefix_hits += len(hits)
        return hits

    def _hash_blocks(self, seq: Sequence, n_full: int) -> None:
        """Extend ``seq.block_hashes`` to its first ``n_full`` blocks (hashed once each)."""
        if len(seq.block_hashes) < n_full:
            seq.block_hashes += chain_block_hashes(
                seq.token_ids[: n_full * self.block_size],
                self.block_size,
                salt=seq.tenant,
                parent=seq.block_hashes[-1] if seq.block_hashes else b"",
                start=len(seq.block_hashes),
            )

    def cached_hashes(self) -> list[bytes]:
        """Every hash the prefix cache holds now (a snapshot for ``events`` consumers)."""
        return list(self._cached)

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block holding ``block_hash`` in the prefix cache, or None (no ref taken)."""
        return self._cached.get(block_hash)

    def take_prefix(self, seq: Sequence, block_ids: list[int]) -> None:
        """Give an empty ``seq`` the cached blocks ``block_ids`` as its first blocks."""
        if seq.block_table:
            raise RuntimeError(f"{seq} already holds blocks")
        for block_id in block_ids:
            self._ref(block_id)
        seq.block_table = list(block_ids)
        seq.num_registered_blocks = len(block_ids)
        seq.num_computed_tokens = seq.num_cached_tokens = len(block_ids) * self.block_size

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of blocks of ``seq`` that became full and computed."""
        if not self.enable_prefix_caching:
            return
        n_full = seq.num_computed_tokens // self.block_size
        self._hash_blocks(seq, n_full)
        for i in range(seq.num_registered_blocks, n_full):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.hash is None and h not in self._cached:
                block.hash = h
                self._cached[h] = block.block_id
                if self.events is not None:
                    self.events.record(True, h)
        seq.num_registered_blocks = max(seq.num_registered_blocks, n_full)

    # -- allocation -----------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens; all or nothing."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            if len(self.blocks) < self.num_blocks:  # a block never handed out before
                block_id = len(self.blocks)
                self.blocks.append(Block(block_id))
            else:
                block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict the stale cache entry of a reused block
                del self._cached[block.hash]
                if self.events is not None:
                    self.events.record(False, block.hash)
                block.hash = None
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; tail blocks go to the free list first (evicted first)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    # -- invariants (tests, debugging) ----------------------------------------------------
    def check_consistency(self, live: Iterable[Sequence]) -> None:
        """Raise if ref counts disagree with the block tables of ``live`` sequences."""
        counts = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                counts[block_id] += 1
        for block in self.blocks:
            if block.ref_count != counts[block.block_id]:
                raise RuntimeError(
                    f"block {block.block_id}: ref {block.ref_count} != {counts[block.block_id]}"
                )
            if (block.ref_count == 0) != (block.block_id in self._free):
                raise RuntimeError(f"block {block.block_id}: free-list membership wrong")
        for h, block_id in self._cached.items():
            if self.blocks[block_id].hash != h:
                raise RuntimeError(f"cache entry for block {block_id} is stale")
