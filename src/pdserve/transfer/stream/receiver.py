"""The decode side of a ``store``/``direct`` hand-off: ``KVReceiver``s of a layer stream.

* ``StreamReceiver``: a layer stream in a remote KVStore endpoint (the KV store, or another
  worker's endpoint), read with ``delete_after_read`` and assembled as the chunks arrive.
* ``LocalReceiver``: a layer stream the prefill worker wrote into this decode worker's own
  endpoint (``direct``); read in-process, no network hop.

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
from pdserve.kvstore.client import KVStoreClient
from pdserve.kvstore.store import KVStore, StoredPayload
from pdserve.transfer.base import (
    HandoffRecord,
    KVLocation,
    TransferState,
    TransportKind,
    advance,
)
from pdserve.transfer.stream.frames import FrameCollector
from pdserve.transfer.stream.header import StreamHeader, read_header

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
    """A layer stream from a remote KVStore endpoint (``store``, or ``direct`` elsewhere)."""

    def __init__(
        self,
        client: KVStoreClient,
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
    """``direct``: the stream the prefill worker wrote into this worker's own endpoint."""

    def __init__(
        self, store: KVStore, location: KVLocation, *, expected_layout: KVLayout | None = None
    ) -> None:
        super().__init__(TransportKind.DIRECT, location)
        self.store = store
        self.expected_layout = expected_layout
        self._consumed = False

    async def _read(self, location: KVLocation, timeout_s: float) -> KVPayload:
        handle = self.store.open_read(location.key)  # UnknownRequestError if absent
        try:
            # Checksums and copies of up to GBs: off the event loop.
            payload = await asyncio.to_thread(self._parse, handle.payload, location)
        finally:
            handle.close()
        self.record.num_bytes = handle.payload.num_bytes
        self.store.delete(location.key, version=handle.payload.version)
        self._consumed = True
        return payload

    def _parse(self, entry: StoredPayload, location: KVLocation) -> KVPayload:
        header = read_header(entry.header)
        _check_header(header, location)
        self.compression = header.compression.value
        if isinstance(entry.attachment, KVPayload):
            # Assembled and checked as it arrived (``services.decode.inbox``): nothing to do.
            if self.expected_layout is not None:
                self.expected_layout.check_compatible(entry.attachment.layout)
            return entry.attachment
        collector = FrameCollector(header, expected_layout=self.expected_layout)
        for data, crc in entry.parts:  # as written, with the CRCs the servicer checked
            collector.feed(data, crc)
        return collector.build()

    async def discard(self) -> None:
        if not self._consumed:
            self._consumed = True
            self.store.delete(self.location.key)
