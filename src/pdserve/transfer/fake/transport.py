"""An in-memory transport for tests, on the real layer frames of ``transfer.stream``, plugged
into the hand-off's connectors as the real ones are (``fake_transports``: the
``TransportRegistry`` a ``PrefillConnector`` and a ``DecodeConnector`` are built with).

``FakeHub`` stands in for the network (one per test, shared by the sender and the receiver):
streams by key, each its header and the chunks ``LayerCopy.seal`` cut its frames into (copied
once into ``bytes``, as the chunk codec copies them into a message). ``FakeReceiver`` feeds
them to a ``FrameCollector``, so every check of the real assembly applies. ``SendFaults``
makes the sender misbehave on purpose: drop layers, corrupt the first one after its checksum
was taken, or stall (the hand-off is never sealed: the commit and a receiver run into their
timeouts). A receiver may start waiting before the sender commits, as a streaming
transport's would.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.errors import InvalidArgumentError, KVTransferError
from pdserve.kvstore.client import Piece
from pdserve.kvstore.keys import handoff_key
from pdserve.transfer.base import (
    HandoffRecord,
    KVLocation,
    KVReceiver,
    KVSender,
    TransferState,
    Transport,
    TransportKind,
    TransportRegistry,
    advance,
)
from pdserve.transfer.compress import Compression
from pdserve.transfer.faults import SendFaults
from pdserve.transfer.stamp import CAPABILITY_BYTES
from pdserve.transfer.stream.frames import FrameCollector, LayerCopy, stream_bytes
from pdserve.transfer.stream.header import StreamHeader, check_layer, missing_layers, read_header

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

FAKE_ADDRESS = "fake"
"""The ``address`` of every fake location (there is no endpoint)."""

PIECE_BYTES = 1 << 20
"""Chunk size the fake cuts frames into (a KVStore client's default)."""


@dataclass(slots=True)
class _Stream:
    header: bytes
    chunks: list[tuple[bytes, int]] = field(default_factory=list)
    """Each chunk's bytes and CRC-32, in the order sent."""
    sealed: threading.Event = field(default_factory=threading.Event)


def _chunk(piece: Piece) -> tuple[bytes, int]:
    """A piece as the chunk carrying it: its lead (a frame's header), if any, then its data,
    with the CRC-32 of both (``LayerCopy.seal`` combined it)."""
    if len(piece) == 3:
        data, crc, lead = piece
        return bytes(lead) + bytes(data), crc
    data, crc = piece
    return bytes(data), crc


class FakeHub:
    """The in-memory wire: streams by key. Thread-safe (the layer hook runs on the engine
    thread, the receiver in the event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}

    def open(self, key: str, header: bytes) -> None:
        with self._lock:
            if key in self._streams:
                raise KVTransferError(f"fake stream {key!r} already exists")
            self._streams[key] = _Stream(header)

    def put(self, key: str, pieces: list[Piece]) -> None:
        """One sealed frame's pieces, each as the chunk that carries it (lead + data)."""
        chunks = [_chunk(piece) for piece in pieces]
        with self._lock:
            self._streams[key].chunks.extend(chunks)

    def seal(self, key: str) -> None:
        with self._lock:
            self._streams[key].sealed.set()

    def wait_sealed(self, key: str, timeout_s: float) -> bool:
        with self._lock:
            stream = self._streams.get(key)
        if stream is None:
            raise KVTransferError(f"fake stream {key!r} does not exist")
        return stream.sealed.wait(timeout_s)

    def take(self, key: str) -> tuple[bytes, list[tuple[bytes, int]]]:
        """Header and chunks of a stream, removing it (single use, like a read-and-delete)."""
        with self._lock:
            stream = self._streams.pop(key, None)
        if stream is None:
            raise KVTransferError(f"fake stream {key!r} is gone")
        return stream.header, stream.chunks

    def discard(self, key: str) -> None:
        with self._lock:
            self._streams.pop(key, None)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._streams)


class FakeSender:
    """A ``KVSender`` into a ``FakeHub``; stands in for a network transport (``direct``)."""

    def __init__(
        self,
        hub: FakeHub,
        *,
        faults: SendFaults | None = None,
        compression: Compression = Compression.NONE,
        kind: TransportKind = TransportKind.DIRECT,
        piece_bytes: int = PIECE_BYTES,
    ) -> None:
        self.hub = hub
        self.faults = faults or SendFaults()
        self.compression = compression
        self.kind = kind
        self.piece_bytes = piece_bytes
        self.state = TransferState.PENDING
        self.record = HandoffRecord(kind.value)
        self.key = ""
        self.capability = b""
        self._header: StreamHeader | None = None
        self._seen: set[int] = set()
        self._error: Exception | None = None

    @property
    def busy_ns(self) -> int:
        return self.record.hook_ns  # every frame is sealed and put inside the hook

    def begin(self, request_id: str, layout: KVLayout, num_tokens: int) -> None:
        if num_tokens < 1:
            raise InvalidArgumentError("num_tokens", f"must be >= 1, got {num_tokens}")
        self.record.send_start_ns = time.monotonic_ns()
        self._header = header = StreamHeader(request_id, layout, num_tokens, self.compression)
        self.capability = secrets.token_bytes(CAPABILITY_BYTES)
        self.key = handoff_key(request_id, self.capability)
        self.record.num_bytes = stream_bytes(header)
        self.hub.open(self.key, header.encode())
        self.state = advance(self.state, TransferState.SENDING)

    def send_layer(self, layer: int, k: KVArray, v: KVArray) -> None:
        start = time.monotonic_ns()
        if self._error is None:
            try:
                self._send(layer, k, v)
            except Exception as err:  # as a real sender: never raise into the engine
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
        corrupt = first and self.faults.corrupts(rid)
        copy = LayerCopy.take(layer, k, v)
        self.hub.put(self.key, copy.seal(self.piece_bytes, self.compression, corrupt=corrupt))

    def planned(self) -> KVLocation:
        h = self._header
        if h is None:
            raise KVTransferError("planned() before begin()")
        return h.location(
            self.kind,
            num_bytes=self.record.num_bytes,
            address=FAKE_ADDRESS,
            key=self.key,
            capability=self.capability,
        )

    async def commit(self, timeout_s: float) -> KVLocation:
        h = self._header
        if self.state is not TransferState.SENDING or h is None:
            raise KVTransferError(f"commit on a sender that is {self.state.name}")
        if self._error is not None:
            raise KVTransferError(f"fake send of {h.request_id!r} failed: {self._error}")
        missing = missing_layers(h.layout, self._seen)
        if missing:
            raise KVTransferError(f"KV layers {missing} of {h.request_id!r} were never sent")
        if self.faults.stalls(h.request_id):
            await asyncio.sleep(timeout_s)  # the stalled stream never ends
            raise KVTransferError(f"fake hand-off not committed within {timeout_s:.3g} s")
        self.hub.seal(self.key)
        self.state = advance(self.state, TransferState.SENT)
        self.record.send_end_ns = time.monotonic_ns()
        return self.planned()

    async def discard(self) -> None:
        if self.state is TransferState.FAILED:
            return
        if self.key:
            self.hub.discard(self.key)
        self.state = advance(self.state, TransferState.FAILED)


class FakeReceiver:
    """A ``KVReceiver`` of one location in a ``FakeHub``."""

    def __init__(
        self, hub: FakeHub, location: KVLocation, *, expected_layout: KVLayout | None = None
    ) -> None:
        self.hub = hub
        self.location = location
        self.expected_layout = expected_layout
        self.kind = location.kind
        self.state = TransferState.PENDING
        self.record = HandoffRecord(location.kind.value)
        self.compression = "none"

    async def receive(self, timeout_s: float) -> KVPayload:
        if not timeout_s > 0:
            raise InvalidArgumentError("timeout_s", f"must be > 0, got {timeout_s}")
        self.state = advance(self.state, TransferState.RECEIVING)
        self.record.recv_start_ns = time.monotonic_ns()
        try:
            payload = await self._receive(self.location, timeout_s)
        except BaseException:
            self.state = advance(self.state, TransferState.FAILED)
            self.hub.discard(self.location.key)
            raise
        self.record.recv_end_ns = time.monotonic_ns()
        self.state = advance(self.state, TransferState.DONE)
        return payload

    async def _receive(self, loc: KVLocation, timeout_s: float) -> KVPayload:
        # A thread waits on the seal (set from the engine thread); bounded by timeout_s.
        if not await asyncio.to_thread(self.hub.wait_sealed, loc.key, timeout_s):
            raise KVTransferError(f"KV stream {loc.key!r} not sealed within {timeout_s:.3g} s")
        header_bytes, chunks = self.hub.take(loc.key)
        header = read_header(header_bytes)
        if header.request_id != loc.request_id or header.num_tokens != loc.num_tokens:
            raise KVTransferError(f"KV stream {loc.key!r} is not the one its location names")
        self.compression = header.compression.value
        collector = FrameCollector(header, expected_layout=self.expected_layout)
        self.record.num_bytes = len(header_bytes)
        for data, crc in chunks:
            collector.feed(data, crc)
            self.record.num_bytes += len(data)
        return collector.build()

    async def discard(self) -> None:
        self.hub.discard(self.location.key)


def fake_transports(
    hub: FakeHub,
    *,
    kinds: tuple[TransportKind, ...] = (TransportKind.DIRECT, TransportKind.STORE),
    faults: SendFaults | None = None,
    compression: Compression = Compression.NONE,
    expected_layout: KVLayout | None = None,
) -> TransportRegistry:
    """A registry whose ``kinds`` all send into ``hub`` and receive from it: what a
    connector is given in place of its real transports. ``expected_layout``: the receiving
    engine's (a payload of another layout is refused, as by the real receivers)."""

    def registered(kind: TransportKind) -> Transport:
        def sender(peer_address: str) -> KVSender:
            return FakeSender(hub, faults=faults, compression=compression, kind=kind)

        def receiver(location: KVLocation, *, follow: bool = False) -> KVReceiver:
            return FakeReceiver(hub, location, expected_layout=expected_layout)

        return Transport(sender=sender, receiver=receiver)

    return TransportRegistry({kind: registered(kind) for kind in kinds})
