"""The decode side of an shm hand-off: ``SegmentReader`` (see ``writer.py`` for the transport;
``handoff.ShmReceiver`` puts it behind the transfer interface).

It reads and checks one sealed segment and unlinks it, on every outcome; with ``follow`` it
reads the segment while its writer still fills it (``follow.py``), for a prefetch. Every
outcome but one: a descriptor whose capability is not the segment's (``transfer.stamp``) is refused
with ``CapabilityError`` before anything is unlinked, claimed, freed or (a slot) mapped.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from concurrent.futures import Executor
from pathlib import Path

from pdserve.engine.kv_payload import KVLayout, KVPayload, kv_fingerprint
from pdserve.errors import InvalidArgumentError, KVPayloadMismatchError, KVTransferError
from pdserve.transfer.base import (
    HandoffRecord,
    KVLocation,
    TransferState,
    TransportKind,
    advance,
)
from pdserve.transfer.janitor import HANDED_OVER, SHM_DIR, segment_state
from pdserve.transfer.shm import segment
from pdserve.transfer.shm.follow import follow_segment, follow_slot, mapped_when_reserved
from pdserve.transfer.shm.slot_mappings import Claim, SlotMappings
from pdserve.transfer.stamp import holds_capability

INLINE_READ_BYTES = 1 << 20
"""A sealed segment up to this size is read on the caller's thread, hashed there alone:
handing it to a worker thread and the K half to the pool costs more than the read (a 0.5 MB
segment, measured here: 0.55-0.65 ms on the caller's thread, 1.0-1.2 ms through a worker thread
and the pool), and it blocks the caller (an event loop) for well under a millisecond."""


class SegmentReader:
    """Decode side: reads and checks one sealed segment, then unlinks it (on every outcome)."""

    kind = TransportKind.SHM

    def __init__(
        self,
        *,
        expected_layout: KVLayout | None = None,
        host: str | None = None,
        shm_dir: Path = SHM_DIR,
        pool: Executor | None = None,
        follow: bool = False,
        inline_bytes: int = INLINE_READ_BYTES,
        slots: SlotMappings | None = None,
    ) -> None:
        self.expected_layout = expected_layout
        self.host = host or socket.gethostname()
        self.shm_dir = shm_dir
        self.pool = pool
        """Hashes the K's beside the reading thread's V's; None: that thread hashes both."""
        self.follow = follow
        """Read the segment while its writer fills it (``follow.py``), not once sealed."""
        self.inline_bytes = inline_bytes
        """Sealed segments up to this size (as the descriptor gives it) are read on the
        caller's thread (``INLINE_READ_BYTES``); 0: always in a worker thread."""
        self.slots = slots
        """This process's kept mappings of reused slots (``slot_mappings.py``); None: a reused slot
        is mapped for this read alone."""
        self.state = TransferState.PENDING
        self.record = HandoffRecord(TransportKind.SHM.value)
        self._path: Path | None = None
        self._pooled = False
        self._generation = 0
        self._capability = b""
        self._stop = threading.Event()

    async def receive(self, descriptor: KVLocation, timeout_s: float) -> KVPayload:
        """Read, verify and unlink the segment; ``timeout_s`` bounds the read.

        The read runs in a worker thread (hashing up to GBs must not stall the event loop),
        except for a small sealed segment (``inline_bytes``), read at once on this thread; it
        checks the deadline between layers.
        """
        if not timeout_s > 0:
            raise InvalidArgumentError("timeout_s", f"must be > 0, got {timeout_s}")
        self.state = advance(self.state, TransferState.RECEIVING)
        self.record.recv_start_ns = time.monotonic_ns()
        try:
            self._path = self._segment_path(descriptor)
            self._pooled = descriptor.generation > 0
            self._generation = descriptor.generation
            self._capability = descriptor.capability
            deadline = time.monotonic() + timeout_s
            if self._pooled:
                read = self._follow_slot if self.follow else self._read_slot
            else:
                read = self._follow_read if self.follow else self._read
            # ``length`` is the segment's whole size; the read checks it against the header.
            inline = not self.follow and 0 < descriptor.length <= self.inline_bytes
            try:
                if inline:
                    plain = self._read_slot if self._pooled else self._read
                    payload = plain(self._path, descriptor, deadline, use_pool=False)
                else:
                    payload = await asyncio.to_thread(read, self._path, descriptor, deadline)
            except asyncio.CancelledError:
                self._stop.set()  # a follow-read's thread would wait on for its writer
                raise
        except BaseException:
            self.state = advance(self.state, TransferState.FAILED)
            raise
        self.record.recv_end_ns = time.monotonic_ns()
        self.record.num_bytes = descriptor.length or descriptor.num_bytes
        self.state = advance(self.state, TransferState.DONE)
        return payload

    def cleanup(self) -> None:
        """Stop a follow-read still waiting for its writer, and unlink the segment if it is
        this reader's, sealed (or aborted), and ``receive`` did not get to (idempotent).

        A segment still being written is its writer's: a follow-read that gave up on a long
        prefill (its bound passed, or it was dropped) leaves it, the writer seals it and the
        ``Decode`` call reads it the plain way; or the writer unlinks it on abort. A reused
        slot is its writer's to keep: a claim on it ends with its payload, and a sealed
        hand-off in it that this reader did not take is freed (``discard_slot``)."""
        self._stop.set()
        if self._pooled:
            if self._path is not None and self.state is not TransferState.DONE:
                self.discard_slot(self._path, self._generation, self._capability)
            return
        path = self._path
        # Never another hand-off's: the segment must hold this reader's capability.
        if (
            path is not None
            and segment_state(path) in HANDED_OVER
            and holds_capability(path, self._capability)
        ):
            segment.unlink(path)

    def _segment_path(self, d: KVLocation) -> Path:
        if d.kind is not TransportKind.SHM:
            raise InvalidArgumentError("descriptor.kind", f"expected shm, got {d.kind.value!r}")
        if d.host and d.host != self.host:
            raise KVTransferError(f"shm segment {d.key!r} is on host {d.host!r}, not {self.host!r}")
        # The name comes off the network: it must name a file directly in shm_dir.
        if not d.key or "/" in d.key or "\0" in d.key or d.key in (".", ".."):
            raise InvalidArgumentError("descriptor.name", f"not a segment name: {d.key!r}")
        return self.shm_dir / d.key

    def _read(
        self, path: Path, d: KVLocation, deadline: float, *, use_pool: bool = True
    ) -> KVPayload:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise KVTransferError(
                f"shm segment {d.key!r} is gone (already read, aborted or reclaimed)"
            ) from None
        owned = False
        try:
            head = segment.read_header(fd, d.offset, d.key, d.capability)
            # Sealed, so ours now: single use, unlinked at once, whatever happens from here on
            # (the open fd keeps it readable). Nobody can open it anew, so what the checksums
            # pass is what the engine imports. (An unsealed or foreign file still belongs to
            # its writer and is left alone.)
            owned = True
            segment.unlink(path)
            self._check(d, head)
            return segment.read_payload(
                fd,
                d.offset,
                head,
                head.checksums,
                deadline,
                self.pool if use_pool else None,
            )
        finally:
            os.close(fd)
            if owned:
                segment.unlink(path)

    def _follow_read(self, path: Path, d: KVLocation, deadline: float) -> KVPayload:
        mm, head = follow_segment(path, deadline, self._stop, self.pool, capability=d.capability)
        segment.unlink(path)  # sealed: ours now, single use
        try:
            self._check(d, head)
            return segment.payload_views(mm, 0, head.layout, head.num_tokens, head.geom)
        except BaseException:
            segment.close_mapping(mm)
            raise

    def _read_slot(
        self, path: Path, d: KVLocation, deadline: float, *, use_pool: bool = True
    ) -> KVPayload:
        """Claim the reused slot, check it on the kept mapping, and hand out views over it;
        the claim ends once the engine imported them (``KVPayload.release``)."""
        claim = self._slot_mappings().claim(path, d.generation, d.capability, deadline)
        try:
            head = segment.mapped_sealed_header(claim.mm, d.key)
            self._check(d, head)
            segment.check_layers(
                claim.mm, 0, head.geom, head.checksums, deadline,
                self.pool if use_pool else None, populate=not claim.populated,
            )  # fmt: skip
            claim.populated_now()
            return self._views(claim, head)
        except BaseException:
            claim.release()
            raise

    def _follow_slot(self, path: Path, d: KVLocation, deadline: float) -> KVPayload:
        slots = self._slot_mappings()
        mm = mapped_when_reserved(slots, path, d.generation, d.capability, deadline, self._stop)
        fresh = not slots.populated(path)
        head = follow_slot(mm, d.key, d.generation, deadline, self._stop, self.pool,
                           capability=d.capability, populate=fresh)  # fmt: skip
        claim = slots.claim(path, d.generation, d.capability, deadline)
        try:
            self._check(d, head)
            claim.populated_now()
            return self._views(claim, head)
        except BaseException:
            claim.release()
            raise

    def discard_slot(self, path: Path, generation: int, capability: bytes) -> None:
        """Give up, unread, the sealed hand-off of ``generation`` in the reused slot at
        ``path`` (``SlotMappings.discard``; only with its ``capability``): its writer may use
        the slot again at once."""
        self._slot_mappings().discard(path, generation, capability)

    def _slot_mappings(self) -> SlotMappings:
        return self.slots if self.slots is not None else SlotMappings(1)

    @staticmethod
    def _views(claim: Claim, head: segment.SegmentHeader) -> KVPayload:
        return segment.payload_views(
            claim.mm, 0, head.layout, head.num_tokens, head.geom, release=claim.release
        )

    def _check(self, d: KVLocation, head: segment.SegmentHeader) -> None:
        """The segment's own header against the descriptor and this engine's layout."""
        name, layout = d.key, head.layout
        if d.length and d.length != head.geom.total:
            raise KVTransferError(
                f"shm segment {name!r}: descriptor length {d.length}, layout implies "
                f"{head.geom.total}"
            )
        if head.num_tokens != d.num_tokens:
            raise KVPayloadMismatchError(
                f"shm segment {name!r} holds {head.num_tokens} tokens; "
                f"the descriptor says {d.num_tokens}"
            )
        if d.model_fingerprint and d.model_fingerprint != kv_fingerprint(layout):
            raise KVPayloadMismatchError(
                f"KV payload fingerprint is {kv_fingerprint(layout)!r} but the "
                f"handle says {d.model_fingerprint!r}"
            )
        if self.expected_layout is not None:
            self.expected_layout.check_compatible(layout)
