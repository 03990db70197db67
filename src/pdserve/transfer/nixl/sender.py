"""``NixlSender``: the prefill side of one nixl hand-off, into the worker's ``NixlPool``.

``begin`` takes the payload's blocks, writes its header and opens the hand-off (its blocks'
tags become its capability); each layer hook writes its frame (``stream.frames`` format:
header, CRC-32 of K then V, K, V) straight into its blocks while the engine computes the later
layers, then the layer's ready mark (``blocks.layer_mark``; x86 stores are seen in order, so a
reader that sees the mark sees the frame, and the CRC guards it anyway); ``commit`` seals the
hand-off (its lease starts) and returns the location naming the blocks. Nothing moves but
by the decode worker's READs: one-sided, the prefill worker's CPU takes no part in them.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from pdserve.engine.kv_payload import KVLayout, kv_fingerprint
from pdserve.errors import InvalidArgumentError, KVTransferError
from pdserve.kvstore.crc import crc32_combine, fast_crc32
from pdserve.transfer.base import (
    HandoffRecord,
    KVLocation,
    TransferState,
    TransportKind,
    advance,
)
from pdserve.transfer.faults import SendFaults
from pdserve.transfer.nixl.blocks import (
    LEN_PREFIX,
    MARK_BYTES,
    frames_offset,
    layer_mark,
    marks_offset,
    payload_bytes,
)
from pdserve.transfer.nixl.pool import NixlPool
from pdserve.transfer.stamp import CAPABILITY_BYTES
from pdserve.transfer.stream.frames import FRAME_HEAD, FRAME_MAGIC, LayerCopy, frame_bytes
from pdserve.transfer.stream.header import StreamHeader, check_layer, missing_layers

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray


def _bytes_of(a: np.ndarray) -> np.ndarray:
    """A ``LayerCopy``'s contiguous host array as its bytes (a view)."""
    return a.reshape(-1).view(np.uint8)


class NixlSender:
    """A ``KVSender`` into a ``NixlPool`` (see the module docstring)."""

    kind = TransportKind.NIXL

    def __init__(self, pool: NixlPool, *, faults: SendFaults | None = None) -> None:
        self.pool = pool
        self.faults = faults or SendFaults()
        self.state = TransferState.PENDING
        self.record = HandoffRecord(TransportKind.NIXL.value)
        self.capability = b""
        self.blocks: list[int] = []
        self._header: StreamHeader | None = None
        self._frames_at = self._marks_at = 0
        self._frame_size = 0
        self._seen: set[int] = set()
        self._error: Exception | None = None
        # The hook's writes and the discard: no layer lands in blocks given back.
        self._lock = threading.Lock()
        self._open = False

    @property
    def busy_ns(self) -> int:
        return self.record.hook_ns  # every layer is written inside the hook

    def begin(self, request_id: str, layout: KVLayout, num_tokens: int) -> None:
        if num_tokens < 1:
            raise InvalidArgumentError("num_tokens", f"must be >= 1, got {num_tokens}")
        self.record.send_start_ns = time.monotonic_ns()
        header = StreamHeader(request_id, layout, num_tokens)
        head = header.encode()
        self._frame_size = frame_bytes(layout, num_tokens, header.compression)
        size = payload_bytes(len(head), layout.num_layers, self._frame_size)
        self.blocks = self.pool.take(size)  # CapacityError: nothing held
        self._header = header
        self._marks_at = marks_offset(len(head))
        self._frames_at = frames_offset(len(head), layout.num_layers)
        self.record.num_bytes = size
        lead = LEN_PREFIX.pack(len(head)) + head
        self.pool.write(self.blocks, 0, np.frombuffer(lead, dtype=np.uint8))
        self.capability = secrets.token_bytes(CAPABILITY_BYTES)
        # The header is in before the tags name the hand-off: a reader that follows sees it.
        self.pool.open(self.capability, request_id, self.blocks)
        self._open = True
        self.state = advance(self.state, TransferState.SENDING)

    def send_layer(self, layer: int, k: KVArray, v: KVArray) -> None:
        start = time.monotonic_ns()
        if self._error is None:
            try:
                self._send(layer, k, v)
            except Exception as err:  # never raise into the engine: ``commit`` raises it
                self._error = err
        self.record.hooked(start, time.monotonic_ns())

    def _send(self, layer: int, k: KVArray, v: KVArray) -> None:
        h = self._header
        if self.state is not TransferState.SENDING or h is None:
            raise KVTransferError(f"send_layer on a sender that is {self.state.name}")
        check_layer(h.layout, h.num_tokens, layer, k, v, self._seen)
        first = not self._seen
        self._seen.add(layer)
        rid = h.request_id
        if self.faults.withholds(rid, layer, len(self._seen)):
            return
        copy = LayerCopy.take(layer, k, v)
        kb, vb = _bytes_of(copy.k), _bytes_of(copy.v)
        crc = crc32_combine(fast_crc32(kb.data), fast_crc32(vb.data), len(vb))
        at = self._frames_at + layer * self._frame_size
        head = FRAME_HEAD.pack(FRAME_MAGIC, layer, len(kb), len(vb), crc)
        if first and self.faults.corrupts(rid):  # after the CRC was taken (fault tests)
            kb = kb.copy()
            kb[0] ^= 0xFF
        with self._lock:
            if not self._open:
                raise KVTransferError(f"hand-off {rid!r} was discarded while it was written")
            self.pool.write(self.blocks, at, np.frombuffer(head, dtype=np.uint8))
            self.pool.write(self.blocks, at + len(head), kb)
            self.pool.write(self.blocks, at + len(head) + len(kb), vb)
            mark = np.frombuffer(layer_mark(self.capability, layer), dtype=np.uint8)
            self.pool.write(self.blocks, self._marks_at + layer * MARK_BYTES, mark)

    def planned(self) -> KVLocation:
        h = self._header
        if h is None:
            raise KVTransferError("planned() before begin()")
        return KVLocation(
            kind=TransportKind.NIXL,
            request_id=h.request_id,
            num_tokens=h.num_tokens,
            num_bytes=self.record.num_bytes,
            model_fingerprint=kv_fingerprint(h.layout),
            address=self.pool.name,
            key=self.pool.fingerprint,
            host=self.pool.host,
            length=self.record.num_bytes,
            blocks=tuple(self.blocks),
            capability=self.capability,
        )

    async def commit(self, timeout_s: float) -> KVLocation:
        h = self._header
        if self.state is not TransferState.SENDING or h is None:
            raise KVTransferError(f"commit on a sender that is {self.state.name}")
        if self._error is not None:
            raise KVTransferError(f"nixl send of {h.request_id!r} failed: {self._error}")
        missing = missing_layers(h.layout, self._seen)
        if missing:
            raise KVTransferError(f"KV layers {missing} of {h.request_id!r} were never sent")
        if self.faults.stalls(h.request_id):
            await asyncio.sleep(timeout_s)  # the stalled hand-off is never sealed
            raise KVTransferError(f"nixl hand-off not committed within {timeout_s:.3g} s")
        self.pool.seal(self.capability, h.request_id, self.blocks)
        self.state = advance(self.state, TransferState.SENT)
        self.record.send_end_ns = time.monotonic_ns()
        return self.planned()

    async def discard(self) -> None:
        """Free the blocks (idempotent); after the commit, revoke the hand-off."""
        if self.state is TransferState.FAILED:
            return
        with self._lock:
            was_open, self._open = self._open, False
        if was_open:
            self.pool.release(self.capability)  # False: its reader freed it already
        self.state = advance(self.state, TransferState.FAILED)
