"""An in-memory transport for tests: the stream format of ``stream.py`` over a dict.

``FakeHub`` stands in for the network (one per test, shared by the sender and the receiver);
``Faults`` makes it misbehave on purpose: drop layers, corrupt their bytes, or stall (the
sender never seals, so a receiver waits until its timeout). The receiver may start waiting
before the sender finishes, as a streaming transport's would.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import torch

from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.errors import InvalidArgumentError, KVTransferError
from pdserve.transfer.base import (
    TransferDescriptor,
    TransferState,
    TransferStats,
    TransportKind,
    advance,
)
from pdserve.transfer.compress import Compression
from pdserve.transfer.stream import (
    LayerFrame,
    PayloadAssembler,
    StreamHeader,
    check_layer,
    missing_layers,
)


@dataclass(frozen=True, slots=True)
class Faults:
    """What a fake sender does wrong."""

    drop_layers: frozenset[int] = frozenset()
    """Layers never delivered (``finish`` still seals: the receiver must notice)."""
    corrupt_layers: frozenset[int] = frozenset()
    """Layers delivered with one data byte flipped after the checksum was taken."""
    stall: bool = False
    """``finish`` returns a descriptor but never seals the stream."""


@dataclass(slots=True)
class _Stream:
    header: bytes
    frames: list[bytes] = field(default_factory=list)
    sealed: threading.Event = field(default_factory=threading.Event)


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

    def put(self, key: str, frame: bytes) -> None:
        with self._lock:
            self._streams[key].frames.append(frame)

    def seal(self, key: str) -> None:
        with self._lock:
            self._streams[key].sealed.set()

    def wait_sealed(self, key: str, timeout_s: float) -> bool:
        with self._lock:
            stream = self._streams.get(key)
        if stream is None:
            raise KVTransferError(f"fake stream {key!r} does not exist")
        return stream.sealed.wait(timeout_s)

    def take(self, key: str) -> tuple[bytes, list[bytes]]:
        """Header and frames of a stream, removing it (single use, like an unlinked segment)."""
        with self._lock:
            stream = self._streams.pop(key, None)
        if stream is None:
            raise KVTransferError(f"fake stream {key!r} is gone")
        return stream.header, stream.frames

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
        faults: Faults | None = None,
        compression: Compression = Compression.NONE,
        kind: TransportKind = TransportKind.DIRECT,
    ) -> None:
        self.hub = hub
        self.faults = faults or Faults()
        self.compression = compression
        self.kind = kind
        self.state = TransferState.PENDING
        self.stats = TransferStats(kind)
        self._header: StreamHeader | None = None
        self._crcs: dict[int, int] = {}
        self._error: Exception | None = None

    def begin(self, request_id: str, layout: KVLayout, num_tokens: int) -> None:
        if num_tokens < 1:
            raise InvalidArgumentError("num_tokens", f"must be >= 1, got {num_tokens}")
        self.stats.send_start_ns = time.monotonic_ns()
        self._header = StreamHeader(request_id, layout, num_tokens, self.compression)
        self.hub.open(request_id, self._header.encode())
        self.state = advance(self.state, TransferState.SENDING)

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        start = time.monotonic_ns()
        if self._error is None:
            try:
                self._send(layer, k, v)
            except Exception as err:  # as a real sender: never raise into the engine
                self._error = err
        end = time.monotonic_ns()
        self.stats.hook_ns += end - start
        self.stats.first_layer_ns = self.stats.first_layer_ns or start
        self.stats.last_layer_ns = end

    def _send(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.state is not TransferState.SENDING or self._header is None:
            raise KVTransferError(f"send_layer on a sender that is {self.state.name}")
        h = self._header
        check_layer(h.layout, h.num_tokens, layer, k, v, self._crcs)
        frame = LayerFrame.from_tensors(layer, k, v, self.compression)
        self._crcs[layer] = frame.crc32
        self.stats.num_bytes += len(frame.keys) + len(frame.values)
        if layer in self.faults.drop_layers:
            return
        data = bytearray(frame.encode())
        if layer in self.faults.corrupt_layers:
            data[-1] ^= 0xFF  # last byte of V: the header (and its checksum) stays intact
        self.hub.put(h.request_id, bytes(data))

    def finish(self) -> TransferDescriptor:
        if self.state is not TransferState.SENDING or self._header is None:
            raise KVTransferError(f"finish on a sender that is {self.state.name}")
        h = self._header
        if self._error is not None:
            err = self._error
            self.abort()
            raise KVTransferError(f"fake send of {h.request_id!r} failed: {err}") from err
        missing = missing_layers(h.layout, self._crcs)
        if missing:
            self.abort()
            raise KVTransferError(f"KV layers {missing} of {h.request_id!r} were never sent")
        if not self.faults.stall:
            self.hub.seal(h.request_id)
        self.state = advance(self.state, TransferState.SENT)
        self.stats.send_end_ns = time.monotonic_ns()
        return TransferDescriptor(
            kind=self.kind,
            request_id=h.request_id,
            num_tokens=h.num_tokens,
            num_bytes=self.stats.num_bytes,
            model_fingerprint=h.layout.model_fingerprint,
            name=h.request_id,
            layout=h.layout,
            layer_checksums=tuple(self._crcs[i] for i in range(h.layout.num_layers)),
            compression=self.compression.value,
        )

    def abort(self) -> None:
        if self.state is TransferState.FAILED:
            return
        if self._header is not None:
            self.hub.discard(self._header.request_id)
        self.state = advance(self.state, TransferState.FAILED)


class FakeReceiver:
    """A ``KVReceiver`` from a ``FakeHub``."""

    def __init__(
        self,
        hub: FakeHub,
        *,
        expected_layout: KVLayout | None = None,
        kind: TransportKind = TransportKind.DIRECT,
    ) -> None:
        self.hub = hub
        self.expected_layout = expected_layout
        self.kind = kind
        self.state = TransferState.PENDING
        self.stats = TransferStats(kind)
        self._key: str | None = None

    async def receive(self, descriptor: TransferDescriptor, timeout_s: float) -> KVPayload:
        if not timeout_s > 0:
            raise InvalidArgumentError("timeout_s", f"must be > 0, got {timeout_s}")
        self.state = advance(self.state, TransferState.RECEIVING)
        self.stats.recv_start_ns = time.monotonic_ns()
        self._key = descriptor.name
        try:
            payload = await self._receive(descriptor, timeout_s)
        except BaseException:
            self.state = advance(self.state, TransferState.FAILED)
            self.cleanup()
            raise
        self.stats.recv_end_ns = time.monotonic_ns()
        self.stats.num_bytes = descriptor.num_bytes
        self.state = advance(self.state, TransferState.DONE)
        return payload

    async def _receive(self, d: TransferDescriptor, timeout_s: float) -> KVPayload:
        # A thread waits on the seal (set from the engine thread); bounded by timeout_s.
        if not await asyncio.to_thread(self.hub.wait_sealed, d.name, timeout_s):
            raise KVTransferError(f"KV stream {d.name!r} not sealed within {timeout_s:.3g} s")
        header_bytes, frames = self.hub.take(d.name)
        header = StreamHeader.decode(header_bytes)
        if header.request_id != d.request_id or header.num_tokens != d.num_tokens:
            raise KVTransferError(f"KV stream {d.name!r} is not the one its descriptor names")
        assembler = PayloadAssembler.from_header(header, expected_layout=self.expected_layout)
        for data in frames:
            frame = LayerFrame.decode(data)
            sent = d.layer_checksums
            if 0 <= frame.layer < len(sent) and sent[frame.layer] != frame.crc32:
                raise KVTransferError(f"KV layer {frame.layer} differs from what was sent")
            assembler.add(frame)
        return assembler.build()

    def cleanup(self) -> None:
        if self._key is not None:
            self.hub.discard(self._key)
