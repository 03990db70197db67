"""``NixlReceiver``: the decode side of one nixl hand-off, on the worker's ``NixlReader``.

A read of one location:

1. The prefill worker's published descriptor (``AgentDirectory``: its heartbeat) is looked
   up by the handle's agent name; its fingerprint must equal both the one published beside
   it and the one the handle names, or nothing is loaded (``KVTransferError``). The agent's
   metadata is loaded once per fingerprint (a restarted worker publishes another).
2. The handle's blocks are checked against the descriptor's pool (ids inside it, as many as
   the length needs, none twice) before any descriptor is built.
3. READ the blocks' tags; each must be the handle's capability (else the blocks are not
   held for this hand-off: released, expired, or never its), then READ the blocks into this
   worker's landing blocks (one descriptor per contiguous run on both sides), then READ the
   tags again (a hand-off freed during the read is refused).
   After the commit (the Decode call's read) the blocks are READ at once, in pieces
   (``PIECE_BYTES``) posted together, each layer checked as soon as its piece has landed,
   while the later pieces are on the wire. A read that follows the writer (``follow``: a
   prefetch, begun with the hand-off) READs each layer as soon as its writer marks it
   (``follow.py``), while the prefill computes the later ones.
4. The payload is checked as a layer stream (``parse.py``: each layer's ready mark, its
   CRC-32, the layout against this engine's). Landing blocks in one run: K and V are views
   over them, lent to the payload until the engine imported it; else copied out, the blocks
   back.
5. The prefill agent is notified (``pool.free_message``, carried by the last READ), and frees
   the blocks (a followed read's at the commit). A read after the commit that fails, and
   ``discard`` of a hand-off never read, notify on their own: a hand-off given up is freed at
   once, not at its lease's end. A followed read that fails or is cancelled leaves the
   hand-off to its Decode call.

Every transfer is polled on the event loop until it is done, failed, or the deadline passed;
one that cannot be released is left with its landing blocks (never reused), so no late write
lands in another hand-off's memory. A peer that disconnected is forgotten (its metadata is
loaded afresh next time).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.errors import InvalidArgumentError, KVTransferError
from pdserve.transfer.base import HandoffRecord, KVLocation, TransferState, advance
from pdserve.transfer.nixl.agent import TAG_BYTES, AgentDescriptor
from pdserve.transfer.nixl.blocks import blocks_for, ranges, runs
from pdserve.transfer.nixl.follow import PIECE_BYTES, Follower, FollowStats
from pdserve.transfer.nixl.parse import PayloadParser
from pdserve.transfer.nixl.pool import free_message
from pdserve.transfer.nixl.reader import NixlReader

logger = logging.getLogger(__name__)


class NixlReceiver:
    """A ``KVReceiver`` of one nixl location (see the module docstring)."""

    def __init__(
        self,
        reader: NixlReader | Callable[[], NixlReader],
        location: KVLocation,
        *,
        expected_layout: KVLayout | None,
        follow: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """``reader``: the worker's, or what makes it at first use (``KVTransferError``
        where it cannot: the read falls back); ``follow``: read each layer as its writer
        marks it (``follow.py``; a prefetch), else the whole payload at once (after the
        commit); ``progress``: the follower's (layers read so far, after each run)."""
        self._reader = reader
        self.follow, self.progress = follow, progress
        self.follow_stats: FollowStats | None = None
        """A followed read's polls and READs (None: not followed)."""
        self.location = location
        self.expected_layout = expected_layout
        self.kind = location.kind
        self.state = TransferState.PENDING
        self.record = HandoffRecord(location.kind.value)
        self.compression = "none"
        self._reached = False  # the peer was resolved: a notification can reach it
        self._notified = False

    async def receive(self, timeout_s: float) -> KVPayload:
        if not timeout_s > 0:
            raise InvalidArgumentError("timeout_s", f"must be > 0, got {timeout_s}")
        self.state = advance(self.state, TransferState.RECEIVING)
        self.record.recv_start_ns = time.monotonic_ns()
        try:
            payload = await self._receive(timeout_s)
        except BaseException:
            self.state = advance(self.state, TransferState.FAILED)
            # A followed read (a prefetch) that fails or is cancelled leaves the hand-off for
            # the Decode call (which reads it, or discards it): only the owner frees it.
            if not self.follow:
                self._notify()
            raise
        self.record.recv_end_ns = time.monotonic_ns()
        self.state = advance(self.state, TransferState.DONE)
        self._notify()
        return payload

    @property
    def reader(self) -> NixlReader:
        r = self._reader
        return r if isinstance(r, NixlReader) else r()

    def _check(self, peer: AgentDescriptor) -> list[tuple[int, int]]:
        """The handle's blocks as remote ranges: inside the pool, enough, none twice."""
        loc = self.location
        blocks = loc.blocks
        if loc.length < 1:
            raise InvalidArgumentError("kv.nixl.length", f"must be >= 1, got {loc.length}")
        need = blocks_for(loc.length, peer.block_bytes)
        if len(blocks) != need:
            raise InvalidArgumentError(
                "kv.nixl.blocks", f"{len(blocks)} blocks for {loc.length} bytes; need {need}"
            )
        if len(set(blocks)) != len(blocks):
            raise InvalidArgumentError("kv.nixl.blocks", "names a block twice")
        for b in blocks:
            peer.block_range(b)  # KVTransferError outside the registered pool
        return ranges(blocks, peer.data_addr, peer.block_bytes, loc.length)

    async def _tags_held(
        self, peer: AgentDescriptor, local: Sequence[int], deadline: float, *, last: bool = False
    ) -> None:
        """Every block's tag is the handle's capability; ``last``: the read's last READ, which
        carries the notification that frees the blocks (a notification of its own would hold
        up this worker's next transfer by milliseconds)."""
        loc, r = self.location, self.reader
        remote = [(peer.tags_addr + b * TAG_BYTES, n * TAG_BYTES) for b, n in runs(loc.blocks)]
        notif = free_message(loc.capability) if last else b""
        tags = await r.read(loc.address, remote, local, deadline, notif=notif)
        self._notified = self._notified or last
        tags = tags.reshape(-1, TAG_BYTES)
        # In run order, which is the handle's block order.
        cap = loc.capability
        wrong = [b for b, tag in zip(loc.blocks, tags, strict=True) if tag.tobytes() != cap]
        if wrong:
            raise KVTransferError(
                f"blocks {wrong[:8]} of {loc.address!r} are not held for hand-off "
                f"{loc.request_id!r} (released, expired, or another's)"
            )

    async def _receive(self, timeout_s: float) -> KVPayload:
        loc, r = self.location, self.reader
        peer = await r.peer(loc)
        self._reached = True
        # The bound is the transfer's: this worker's first nixl hand-off registers its
        # landing blocks, and a new peer's metadata is loaded, before it starts.
        deadline = time.monotonic() + timeout_s
        remote = self._check(peer)
        tag_blocks = r.take(len(loc.blocks) * TAG_BYTES)
        data_blocks: list[int] = []
        lent = False
        try:
            await self._tags_held(peer, tag_blocks, deadline)
            data_blocks = r.take(loc.length)
            # Landing blocks in one run: the layers are checked as the pieces land (while the
            # rest are on the wire), and K and V are views over them (no copy), lent until the
            # engine imported them; else the frames are copied out of a gathered copy.
            in_place = len(runs(data_blocks)) == 1
            parser = PayloadParser(
                loc, self.expected_layout, in_place=in_place, marks=not self.follow
            )
            if in_place:
                parser.view = r.landing(data_blocks, loc.length).data.cast("B").toreadonly()
            if self.follow:
                follower = Follower(
                    r, peer, loc, parser, data_blocks=data_blocks, deadline=deadline,
                    progress=self.progress,
                )  # fmt: skip
                self.follow_stats = follower.stats
                await follower.run()
                if not in_place:
                    parser.view = r.landing(data_blocks, loc.length).data.cast("B").toreadonly()
                    parser.arrived(loc.length)
            elif in_place:
                await r.read(
                    loc.address, remote, data_blocks, deadline,
                    on_piece=parser.arrived, piece_bytes=PIECE_BYTES,
                )  # fmt: skip
            else:
                data = await r.read(loc.address, remote, data_blocks, deadline)
                parser.view = data.data.cast("B").toreadonly()
                parser.arrived(loc.length)
            # Accepted only if the blocks were still this hand-off's after the read.
            await self._tags_held(peer, tag_blocks, deadline, last=True)
            payload = parser.build()
            self.compression = parser.compression
            if in_place:
                payload, lent = r.lend(payload, data_blocks), True
        finally:
            r.give_back(tag_blocks)
            if not lent:
                r.give_back(data_blocks)
        self.record.num_bytes = loc.length
        return payload

    def _notify(self) -> None:
        if self._reached and not self._notified:
            self._notified = True
            try:
                self.reader.notify_free(self.location.address, self.location.capability)
            except Exception as err:  # a dead peer: its blocks went with it
                logger.warning(
                    "NIXL: could not tell %s to free %s: %r",
                    self.location.address, self.location.request_id, err,
                )  # fmt: skip

    async def discard(self) -> None:
        """Tell the prefill worker to free the blocks if no read did (idempotent): a hand-off
        given up unread (a refused call) is freed at once, not at its lease's end."""
        if not self._reached and not self._notified:
            try:
                await self.reader.peer(self.location)
                self._reached = True
            except KVTransferError as err:
                logger.warning(
                    "NIXL: %s given up unread, its agent unreachable (%s); its lease frees it",
                    self.location.request_id, err,
                )  # fmt: skip
        self._notify()
