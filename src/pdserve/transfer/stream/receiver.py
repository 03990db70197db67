"""The decode side of a ``store``/``direct`` hand-off: ``KVReceiver``s of a layer stream.

* ``StreamReceiver``: a layer stream in the KV store (``store``), read with
  ``delete_after_read`` and assembled as the chunks arrive.
* ``LocalReceiver``: a layer stream the prefill worker pushed into this decode worker
  (``direct``, ``Decode.Push``), assembled as it landed (``inbox.Inbox``); taken in-process.

Every receive is bounded by ``timeout_s``; a timeout, a broken stream, a bad checksum or a
missing entry raises ``KVTransferError`` or ``UnknownRequestError`` (the decode worker then
recomputes), a payload of another model ``KVPayloadMismatchError``. ``discard`` frees the
transport's copy if ``receive`` did not consume it, so nothing outlives the request.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.errors import KVTransferError, PdServeError
from pdserve.kvstore.backend import StoreClient
from pdserve.transfer.base import (
    HandoffRecord,
    KVLocation,
    TransferState,
    TransportKind,
    advance,
)
from pdserve.transfer.stream.frames import FrameCollector
from pdserve.transfer.stream.header import StreamHeader, read_header
from pdserve.transfer.stream.inbox import Inbox

logger = logging.getLogger(__name__)


def _check_header(header: StreamHeader, location: KVLocation) -> None:
    if header.request_id != location.request_id or header.num_tokens != location.num_tokens:
        raise KVTransferError(
            f"KV entry {location.key!r} holds {header.request_id!r} with {header.num_tokens} "
            f"tokens; the handle names {location.request_id!r} with {location.num_tokens}"
        )


class _Timed:
    """State and timing common to the stream receivers."""

    def __init__(self, kind: TransportKind, location: KVLocation) -> None:
        self.kind = kind
        self.location = location
        self.state = TransferState.PENDING
        self.record = HandoffRecord(kind.value)
        self.compression = "none"

    async def receive(self, timeout_s: float) -> KVPayload:
        """The verified payload, within ``timeout_s``."""
        return await self._timed(self.location, timeout_s)

    async def _timed(self, location: KVLocation, timeout_s: float) -> KVPayload:
        self.state = advance(self.state, TransferState.RECEIVING)
        self.record.recv_start_ns = time.monotonic_ns()
        try:
            async with asyncio.timeout(timeout_s):
                payload = await self._read(location, timeout_s)
        except TimeoutError:
            self.state = advance(self.state, TransferState.FAILED)
            raise KVTransferError(
                f"{self.kind} receive of {location.request_id!r} took more than {timeout_s:.3g} s"
            ) from None
        except BaseException:
            self.state = advance(self.state, TransferState.FAILED)
            raise
        self.record.recv_end_ns = time.monotonic_ns()
        self.state = advance(self.state, TransferState.DONE)
        return payload

    async def _read(self, location: KVLocation, timeout_s: float) -> KVPayload:
        raise NotImplementedError


class StreamReceiver(_Timed):
    """A layer stream from a KVStore endpoint (``store``)."""

    def __init__(
        self,
        client: StoreClient,
        location: KVLocation,
        *,
        expected_layout: KVLayout | None = None,
        follow: bool = False,
    ) -> None:
        """``follow``: read the entry while its writer still puts it (a prefetch)."""
        super().__init__(location.kind, location)
        self.client = client
        self.expected_layout = expected_layout
        self.follow = follow
        self._consumed = False

    async def _read(self, location: KVLocation, timeout_s: float) -> KVPayload:
        collector: FrameCollector | None = None
        stream = self.client.stream(
            location.key, delete_after_read=True, timeout_s=timeout_s, follow=self.follow
        )
        try:
            async for chunk in stream:
                if collector is None:
                    header = read_header(chunk.header)
                    _check_header(header, location)
                    self.compression = header.compression.value
                    collector = FrameCollector(header, expected_layout=self.expected_layout)
                    self.record.num_bytes += len(chunk.header)
                collector.feed(chunk.data, chunk.crc32)  # checked by the client's reader
                self.record.num_bytes += len(chunk.data)
        finally:
            await stream.aclose()
        # The whole stream went out, so the store deleted the entry (delete_after_read).
        self._consumed = True
        if collector is None:
            raise KVTransferError(f"KV entry {location.key!r} is empty")
        return collector.build()

    async def discard(self) -> None:
        """Delete the entry unless a read consumed it (best effort: its lease ends it)."""
        if self._consumed:
            return
        self._consumed = True
        key = self.location.key
        try:
            await self.client.delete(key)
        except PdServeError as err:
            logger.warning("could not delete %s at %s: %s", key, self.client.address, err)


class LocalReceiver(_Timed):
    """``direct``: the hand-off the prefill worker pushed into this worker's ``Inbox``, taken
    by the location's key (capability included). A hand-off pushed to another worker, or
    none, is not there: ``UnknownRequestError``, and the caller recomputes. ``inbox`` None:
    this worker takes no pushes."""

    def __init__(
        self, inbox: Inbox | None, location: KVLocation, *, expected_layout: KVLayout | None = None
    ) -> None:
        super().__init__(TransportKind.DIRECT, location)
        self.inbox = inbox
        self.expected_layout = expected_layout
        self._consumed = False

    async def _read(self, location: KVLocation, timeout_s: float) -> KVPayload:
        if self.inbox is None:
            raise KVTransferError(f"direct hand-off {location.request_id!r}: no inbox here")
        entry = self.inbox.take(location.key)  # UnknownRequestError if not here
        self._consumed = True
        # Checked and assembled as it arrived (``inbox.Inbox``): nothing left to do.
        _check_header(entry.header, location)
        self.compression = entry.header.compression.value
        if self.expected_layout is not None:
            self.expected_layout.check_compatible(entry.payload.layout)
        self.record.num_bytes = entry.num_bytes
        return entry.payload

    async def discard(self) -> None:
        if not self._consumed:
            self._consumed = True
            if self.inbox is not None:
                self.inbox.drop(self.location.key)
