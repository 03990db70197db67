"""The decode side of a ``direct`` hand-off as it lands: ``Inbox``, fed by ``Decode.Push``.

The prefill worker pushes a hand-off's layer stream into the decode worker while it computes
(``push.PushClient``). The ``Push`` servicer hands the chunks to ``Inbox.receive``, which feeds
them to a ``FrameCollector`` as they arrive instead of keeping them: each frame is checked (its
CRC combined from the chunks' already checked ones) and its K and V become tensors over the
received pieces (a layer whose K and V each fit a chunk) or over a buffer the frame was copied
into once. At the last chunk the assembled ``KVPayload`` is held under the stream's key, so the
``Decode`` call that follows (``receiver.LocalReceiver``) only takes it: decoding starts as soon
as the last layer has landed.

* The key must be a hand-off's, ``kv/{request_id}/{capability hex}`` (``kvstore.keys.handoff_key``),
  naming the header's request: a ``Decode`` call takes the entry by its handle's key, so only
  a caller that knows the capability can take (or ``drop``) it. A malformed key or header is
  ``InvalidArgumentError`` naming the field, before any data is kept.
* The inbox holds at most ``capacity_bytes`` (header + data of held and arriving hand-offs);
  a stream's announced ``total_bytes`` is reserved at its first chunk, so one that cannot fit
  is refused (``CapacityError``) before its data arrives.
* A frame that fails its check fails the stream, reported once the stream is read (a server
  that ends a client stream early leaves the client with a bare "internal error" instead of
  the reason); the prefill worker then answers ``recompute``. A stream that breaks off leaves
  nothing behind.
* An entry that no ``Decode`` call takes is dropped when its lease ends (``sweep``), as is a
  stream that stalls for a whole lease.

Event-loop only (not thread-safe), like the servicer that feeds it.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass

from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.errors import (
    CapacityError,
    InvalidArgumentError,
    KVPayloadMismatchError,
    KVTransferError,
    PdServeError,
    UnknownRequestError,
)
from pdserve.kvstore.chunks import ChunkReader, CrcPipeline
from pdserve.kvstore.entry import Leases
from pdserve.kvstore.keys import HANDOFF_PREFIX
from pdserve.kvstore.wire import Buffer, Chunk
from pdserve.transfer.stamp import CAPABILITY_BYTES
from pdserve.transfer.stream.frames import FrameCollector
from pdserve.transfer.stream.header import StreamHeader, read_header

_CAPABILITY_HEX = re.compile(f"[0-9a-f]{{{2 * CAPABILITY_BYTES}}}")


def request_of_key(key: str) -> str:
    """The request a hand-off key names; ``InvalidArgumentError`` (field ``key``) unless the
    key is ``kv/{request_id}/{capability hex}``."""
    if not key:
        raise InvalidArgumentError("key", "the first chunk must carry the hand-off's key")
    if not key.startswith(HANDOFF_PREFIX):
        raise InvalidArgumentError("key", f"must be in the {HANDOFF_PREFIX!r} namespace")
    request_id, _, capability = key[len(HANDOFF_PREFIX) :].rpartition("/")
    if not request_id or not _CAPABILITY_HEX.fullmatch(capability):
        raise InvalidArgumentError(
            "key",
            f"must be {HANDOFF_PREFIX}{{request_id}}/{{capability}}, the capability "
            f"{2 * CAPABILITY_BYTES} lowercase hex digits",
        )
    return request_id


@dataclass(frozen=True, slots=True)
class Pushed:
    """One hand-off the inbox holds, checked and assembled."""

    key: str
    header: StreamHeader
    payload: KVPayload
    num_bytes: int
    """Header + data bytes received."""
    expires_at: float


@dataclass(frozen=True, slots=True)
class Received:
    """What a whole ``Push`` stream left (``PutResponse``)."""

    key: str
    num_bytes: int
    num_chunks: int
    lease_s: float


@dataclass(frozen=True, slots=True)
class InboxStats:
    used_bytes: int
    """Held entries' bytes plus the room reserved by streams still arriving."""
    capacity_bytes: int
    num_entries: int
    num_writing: int


class _Arrival:
    """One stream being assembled: its reservation, its collector, its first failure."""

    def __init__(
        self, key: str, collector: FrameCollector, num_bytes: int, reserved: int, deadline: float
    ) -> None:
        self.key = key
        self.collector = collector
        self.num_bytes = num_bytes
        """Header + data bytes received so far."""
        self.reserved = reserved
        self.deadline = deadline
        self.error: PdServeError | None = None
        self.closed = False

    def feed(self, data: Buffer, crc32: int) -> None:
        if self.error is not None:
            return  # already refused: the rest is only read off the stream
        try:
            self.collector.feed(data, crc32)
        except PdServeError as err:  # raised at the end of the stream, so its reason reaches
            self.error = err  # the sender
            self.collector.frames.clear()


class Inbox:
    """The ``direct`` hand-offs pushed into this decode worker, by key (module docstring).

    ``expected_layout``: the decode engine's; a stream of another model or dtype is refused
    at its header (``KVPayloadMismatchError``). ``default_lease_s``: the lease of a stream
    that asks for none (0); ``max_lease_s`` caps what one may ask for.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        expected_layout: KVLayout | None = None,
        default_lease_s: float = 60.0,
        max_lease_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes < 1:
            raise InvalidArgumentError("capacity_bytes", f"must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.expected_layout = expected_layout
        self.leases = Leases(default_lease_s, max_lease_s)
        self._clock = clock
        self._entries: dict[str, Pushed] = {}
        self._arrivals: set[_Arrival] = set()
        self._used = 0

    # -- receiving -------------------------------------------------------------------------
    async def receive(self, chunks: AsyncIterable[Chunk]) -> Received:
        """Take one ``Push`` stream, chunk by chunk, and hold its payload under its key.

        Seq is checked at once, CRC-32s beside the loop (``CrcPipeline``, drained before the
        entry is held). Raises ``InvalidArgumentError`` (a malformed stream, key or header),
        ``KVPayloadMismatchError`` (another model), ``CapacityError`` (the inbox is full) or
        ``KVTransferError`` (a bad frame or chunk, a missing layer, a stream ended short).
        """
        reader = ChunkReader(limit_bytes=self.capacity_bytes, verify=False)
        crcs = CrcPipeline()
        arrival: _Arrival | None = None
        lease = 0.0
        try:
            async for chunk in chunks:
                data = reader.feed(chunk)
                await crcs.check(chunk)
                if arrival is None:
                    crcs.key = reader.key
                    lease = self.leases.of(reader.lease_s)
                    arrival = self._begin(reader, lease)
                if data:
                    self._account(arrival, len(data), lease)
                    arrival.feed(data, chunk.crc32)
            if arrival is None:
                raise InvalidArgumentError("key", "the Push stream carried no chunk")
            reader.check_complete()
            await crcs.drain()
            self._commit(arrival, lease)
        finally:
            crcs.cancel()
            if arrival is not None:
                self._end(arrival)  # a no-op after the commit
        return Received(reader.key, reader.num_bytes, reader.num_chunks, lease)

    def _begin(self, reader: ChunkReader, lease: float) -> _Arrival:
        """The arrival of a stream whose first chunk ``reader`` has read: its key and header
        checked, its announced size reserved."""
        request_id = request_of_key(reader.key)
        if not reader.header:
            raise InvalidArgumentError("header", "the first chunk must carry the stream header")
        try:
            header = read_header(reader.header)
        except (KVTransferError, KVPayloadMismatchError) as err:  # no magic; unreadable
            raise InvalidArgumentError("header", f"not a layer stream header: {err}") from err
        if header.request_id != request_id:
            raise InvalidArgumentError(
                "header.request_id",
                f"{header.request_id!r} differs from the key's {request_id!r}",
            )
        collector = FrameCollector(header, expected_layout=self.expected_layout)
        need = max(reader.total_bytes, len(reader.header))
        self._reserve(reader.key, need)
        arrival = _Arrival(reader.key, collector, len(reader.header), need, self._clock() + lease)
        self._arrivals.add(arrival)
        return arrival

    def _reserve(self, key: str, num_bytes: int) -> None:
        if self._used + num_bytes > self.capacity_bytes:
            raise CapacityError(
                f"inbox full: {key!r} needs {num_bytes} bytes, "
                f"{self.capacity_bytes - self._used} of {self.capacity_bytes} free"
            )
        self._used += num_bytes

    def _account(self, arrival: _Arrival, num_data: int, lease: float) -> None:
        """Count ``num_data`` more bytes of ``arrival`` (growing its room past what it
        announced, if it announced nothing)."""
        if arrival.closed:
            raise KVTransferError(f"push of {arrival.key!r} is closed: its lease ran out")
        arrival.deadline = self._clock() + lease  # a stream making progress lives on
        arrival.num_bytes += num_data
        if arrival.num_bytes > arrival.reserved:
            self._reserve(arrival.key, arrival.num_bytes - arrival.reserved)
            arrival.reserved = arrival.num_bytes

    def _commit(self, arrival: _Arrival, lease: float) -> None:
        if arrival.closed:
            raise KVTransferError(f"push of {arrival.key!r} is closed: its lease ran out")
        if arrival.error is not None:
            raise arrival.error
        payload = arrival.collector.build()  # KVTransferError if a layer is missing
        old = self._entries.pop(arrival.key, None)  # a push again under the key replaces it
        if old is not None:
            self._used -= old.num_bytes
        self._arrivals.discard(arrival)
        arrival.closed = True
        self._used += arrival.num_bytes - arrival.reserved  # the room becomes the entry's
        self._entries[arrival.key] = Pushed(
            arrival.key, arrival.collector.header, payload, arrival.num_bytes,
            self._clock() + lease,
        )  # fmt: skip

    def _end(self, arrival: _Arrival) -> None:
        """Give back the room of a stream that did not commit (idempotent)."""
        if arrival in self._arrivals:
            self._arrivals.discard(arrival)
            self._used -= arrival.reserved
            arrival.collector.frames.clear()
        arrival.closed = True

    # -- taking ----------------------------------------------------------------------------
    def take(self, key: str) -> Pushed:
        """Remove and return the hand-off under ``key``; ``UnknownRequestError`` if it is not
        here (never pushed, dropped, expired, or a key with another capability)."""
        entry = self._entries.get(key)
        if entry is None or entry.expires_at <= self._clock():
            self.drop(key)
            raise UnknownRequestError(f"no pushed KV under {key!r}")
        self.drop(key)
        return entry

    def drop(self, key: str) -> bool:
        """Free the hand-off under ``key``; False if it is not here."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._used -= entry.num_bytes
        return True

    def sweep(self) -> int:
        """Drop entries past their lease and end streams stalled for a whole lease; returns
        the entries dropped."""
        now = self._clock()
        expired = [k for k, e in self._entries.items() if e.expires_at <= now]
        for key in expired:
            self.drop(key)
        for arrival in [a for a in self._arrivals if a.deadline <= now]:
            self._end(arrival)  # its stream fails at its next chunk
        return len(expired)

    def stats(self) -> InboxStats:
        return InboxStats(
            used_bytes=self._used,
            capacity_bytes=self.capacity_bytes,
            num_entries=len(self._entries),
            num_writing=len(self._arrivals),
        )

    def close(self) -> None:
        """Drop everything."""
        for arrival in list(self._arrivals):
            self._end(arrival)
        for key in list(self._entries):
            self.drop(key)
