"""Reading a nixl hand-off while its writer is still writing it (a prefetch).

The writer marks each layer once its frame is in its blocks (``blocks.layer_mark``: keyed by
the hand-off's capability, so a mark an earlier hand-off left in the same blocks never
passes). A reader told of the hand-off as it began (``Decode.Prefetch``), having checked
that every block's tag names the hand-off (``NixlReceiver``), follows it:

1. READ the payload's lead and parse its header (the writer wrote it before the tags).
2. Poll: one small READ of the first block's tag and the marks. A tag that no longer names
   the hand-off is a writer that gave up (its blocks are freed, tags first): the read ends
   with ``KVTransferError``. Else every layer newly marked, from the next one on, is READ in
   one transfer (one descriptor per contiguous run of blocks; consecutive layers coalesced)
   and checked as its pieces land (``PayloadParser``), while the prefill computes the later
   layers.
3. After the last layer the receiver READs every tag again (a hand-off freed or revoked
   during the read is refused), which notifies the writer's agent as a read after the commit
   does; its pool frees the blocks at the commit, never under the writer.

Polls are paced as shm's follower paces its (``transfer.pacing``): a backoff from 50 us to
2 ms, and from the third layer on, once the next layer is due judging by the previous
interval, at most 100 us for up to 50 ms. The pauses are the event loop's timers
(NIXL has no awaitable), whose resolution bounds the shortest one (1 ms with epoll). A
cancelled read (its ``Prefetch`` call was) stops at its next await; the deadline bounds it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.errors import KVTransferError
from pdserve.transfer import pacing
from pdserve.transfer.base import KVLocation
from pdserve.transfer.nixl.agent import TAG_BYTES, AgentDescriptor
from pdserve.transfer.nixl.blocks import MARK_BYTES, layer_mark, pair_ranges, ranges
from pdserve.transfer.nixl.parse import PayloadParser
from pdserve.transfer.nixl.reader import NixlReader

LEAD_BYTES = 4096
"""The first READ of the payload: its header, usually whole."""
PIECE_BYTES = 4 * 1024 * 1024
"""A run of layers is READ in pieces of this size, checked as each one lands."""


@dataclass(slots=True)
class FollowStats:
    """What a followed read did: polls of the marks, READs of layer runs, their time."""

    polls: int = 0
    reads: int = 0
    layers: int = 0
    read_ns: int = 0
    """Wall time of the layer READs, from posting to the last piece checked."""


class Follower:
    """One followed read (module docstring) into ``data_blocks`` (the payload's landing
    blocks, the caller's); its polls land in blocks of its own, taken for the read."""

    def __init__(
        self,
        reader: NixlReader,
        peer: AgentDescriptor,
        loc: KVLocation,
        parser: PayloadParser,
        *,
        data_blocks: Sequence[int],
        deadline: float,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """``progress``: called with the number of layers read after each run of them (and
        checked, when the landing is one run)."""
        self.r, self.peer, self.loc, self.parser = reader, peer, loc, parser
        self.data_blocks = list(data_blocks)
        self.poll_blocks: list[int] = []
        self.deadline, self.progress = deadline, progress
        self.stats = FollowStats()
        self.done = 0  # layers READ

    async def run(self) -> None:
        """READ and check every layer as its writer marks it (``KVTransferError`` if it
        gives up, or past the deadline)."""
        await self._lead()
        p = self.parser
        layers = p.num_layers
        marks = b"".join(layer_mark(self.loc.capability, i) for i in range(layers))
        self.poll_blocks = self.r.take(TAG_BYTES + len(marks))
        try:
            await self._follow(marks)
        finally:
            self.r.give_back(self.poll_blocks)

    async def _follow(self, marks: bytes) -> None:
        layers = self.parser.num_layers
        seen: list[float] = []  # when each run's marks were found
        while self.done < layers:
            ready = await self._marked(marks, pacing.due_after(seen))
            seen.append(time.monotonic())
            start = time.monotonic_ns()
            await self._layers(self.done, ready)
            self.stats.read_ns += time.monotonic_ns() - start
            self.stats.reads += 1
            self.stats.layers += ready - self.done
            self.done = ready
            if self.progress is not None:
                self.progress(ready)

    async def _span(
        self, start: int, length: int, on_piece: Callable[[int], None] | None = None
    ) -> None:
        """READ payload bytes ``start..start+length`` to the same offsets of the landing
        (in pieces of ``PIECE_BYTES``; ``on_piece``: ``NixlReader.read``'s)."""
        r, peer = self.r, self.peer
        local = ranges(self.data_blocks, r.base, r.block_bytes, length, start)
        remote = ranges(self.loc.blocks, peer.data_addr, peer.block_bytes, length, start)
        await r.read_pairs(
            self.loc.address, pair_ranges(local, remote), self.data_blocks, self.deadline,
            on_piece=on_piece, piece_bytes=PIECE_BYTES,
        )  # fmt: skip

    async def _lead(self) -> None:
        p, length = self.parser, self.loc.length
        got = 0
        need = min(length, LEAD_BYTES)
        while need:
            if need > length:
                raise KVTransferError(f"nixl payload of {self.loc.request_id!r}: bad header")
            await self._span(got, need - got)
            got = need
            lead = p.view if p.in_place else self.r.landing(self.data_blocks, got).data.cast("B")
            need = p.header(lead, got)

    async def _marked(self, marks: bytes, due: float) -> int:
        """Poll until the next layer is marked; the end of the run of marked layers from it
        (paced by ``transfer.pacing`` from ``due`` on)."""
        r, peer, loc, p = self.r, self.peer, self.loc, self.parser
        size = len(marks)
        local = ranges(self.poll_blocks, r.base, r.block_bytes, TAG_BYTES + size)
        tag = (peer.tags_addr + loc.blocks[0] * TAG_BYTES, TAG_BYTES)
        remote = [tag, *ranges(loc.blocks, peer.data_addr, peer.block_bytes, size, p.marks_at)]
        pairs = pair_ranges(local, remote)
        delay = pacing.WAIT_MIN_S
        while True:
            await r.read_pairs(loc.address, pairs, self.poll_blocks, self.deadline)
            self.stats.polls += 1
            got = r.landing(self.poll_blocks, TAG_BYTES + size).tobytes()
            if got[:TAG_BYTES] != loc.capability:
                raise KVTransferError(
                    f"nixl hand-off {loc.request_id!r}: its writer gave up (blocks freed)"
                )
            ready = self.done
            while ready < p.num_layers and _mark(got, ready) == _mark(marks, ready, 0):
                ready += 1
            if ready > self.done:
                return ready
            if time.monotonic() >= self.deadline:
                raise KVTransferError(
                    f"nixl read of {loc.request_id!r} timed out waiting for layer {self.done}"
                )
            await asyncio.sleep(delay)
            delay = pacing.next_wait(delay, due, time.monotonic())

    async def _layers(self, first: int, end: int) -> None:
        """READ layers ``first..end-1`` (their frames are contiguous), checked as they land
        when the landing is one run (else at the end, from a gathered copy)."""
        p = self.parser
        start = p.at + first * p.frame
        on_piece = (lambda landed: p.arrived(start + landed)) if p.in_place else None
        await self._span(start, (end - first) * p.frame, on_piece)


def _mark(buf: bytes, layer: int, at: int = TAG_BYTES) -> bytes:
    """Layer ``layer``'s mark in ``buf``, whose marks start at ``at``."""
    off = at + layer * MARK_BYTES
    return buf[off : off + MARK_BYTES]
