"""The prefill side of a ``store``/``direct`` hand-off: ``StreamSender``, a ``KVSender``.

A chunk stream opened at ``begin``: a ``KVStore.Put`` into the KV store (``store``), or a
``Decode.Push`` straight into the decode worker (``direct``, ``push.PushClient``). The layer
hook takes each layer (engine thread; a GPU's is copied to the host) and queues it to be
sealed (the frame's CRCs computed): a small layer by the event loop as it sends it, a large
one at once by the sealing thread. The event loop sends
each sealed frame as soon as it is ready, while the engine computes the next layers. The last
layer ends the stream; ``commit`` waits, bounded, for the endpoint's acknowledgement.

The layer hook (``send_layer``) never raises: it runs inside the engine's batched forward
pass. A failure is recorded and raised by ``commit``. ``discard`` frees whatever the hand-off
holds on every other path (a stream still missing layers is cancelled, so the endpoint drops
the partial entry; one whose last layer ended it, committed or not, is deleted at the endpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterable, Callable
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Protocol

from pdserve.engine.kv_payload import KVLayout
from pdserve.errors import InvalidArgumentError, KVTransferError, PdServeError
from pdserve.kvstore.client import Bytes, Piece, PutResult
from pdserve.kvstore.keys import handoff_key
from pdserve.transfer.base import (
    HandoffRecord,
    KVLocation,
    TransferState,
    TransportKind,
    advance,
)
from pdserve.transfer.compress import Compression
from pdserve.transfer.faults import SendFaults
from pdserve.transfer.stamp import CAPABILITY_BYTES
from pdserve.transfer.stream.frames import LayerCopy, frame_bytes, stream_bytes
from pdserve.transfer.stream.header import StreamHeader, check_layer, missing_layers

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

logger = logging.getLogger(__name__)

INLINE_SEAL_BYTES = 4 * 1024 * 1024
"""Uncompressed frames up to this size (2048 tokens of the base preset) are sealed by the event
loop as it sends them; larger ones, and int8 ones (quantizing is the heavier part), by the
sealing thread as soon as they are taken (``StreamSender``)."""

Sealing = Future[list[Piece]] | Callable[[], list[Piece]]
"""A taken layer on its way to the wire: its seal running in the sealing thread, or to be
run by the event loop."""


class StreamTarget(Protocol):
    """Where a layer stream goes: the KV store (``KVStoreClient``, a ``KVStore.Put``) or a
    decode worker (``push.PushClient``, a ``Decode.Push``)."""

    @property
    def address(self) -> str: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def timeout_s(self) -> float: ...

    async def put_stream(
        self,
        key: str,
        pieces: AsyncIterable[Bytes | Piece],
        *,
        header: bytes = b"",
        total_bytes: int = 0,
        lease_s: float = 0.0,
        timeout_s: float | None = None,
    ) -> PutResult:
        """Stream the pieces under ``key``; returns once the endpoint holds all of them."""
        ...

    async def delete(self, key: str, *, timeout_s: float | None = None) -> bool:
        """Free what the endpoint holds under ``key``; False if nothing."""
        ...


class StreamSender:
    """``store``/``direct``: the layer stream into the KV store or a decode worker (see the
    module doc)."""

    def __init__(
        self,
        client: StreamTarget,
        kind: TransportKind,
        *,
        lease_s: float,
        compression: Compression = Compression.NONE,
        sealer: Executor,
        faults: SendFaults | None = None,
    ) -> None:
        """``sealer``: the one thread that seals large frames, shared by a worker's senders
        (one, so that frames are sealed in the order they were taken); its owner shuts it
        down."""
        if kind not in (TransportKind.STORE, TransportKind.DIRECT):
            raise InvalidArgumentError("kind", f"a stream goes to store or direct, not {kind}")
        self.client = client
        self.kind: TransportKind = kind
        self.lease_s = lease_s
        self.compression = compression
        self.faults = faults
        self.state = TransferState.PENDING
        self.record = HandoffRecord(kind.value)
        self.key = ""
        self.capability = b""
        """The hand-off's capability (``kvstore.keys.handoff_key``), chosen by ``begin``."""
        self._header: StreamHeader | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sealer = sealer
        self._queue: asyncio.Queue[Sealing | None] = asyncio.Queue()
        self._inline = False  # seal in the event loop (``INLINE_SEAL_BYTES``)
        self._task: asyncio.Task[PutResult] | None = None
        self._seen: set[int] = set()  # engine thread only
        self._error: Exception | None = None
        self._end_queued = False  # the last layer queued the stream's end (engine thread)
        self._busy_ns = 0  # sealing frames and gRPC taking their pieces (flow control included)
        self._last_sent_ns = 0

    @property
    def busy_ns(self) -> int:
        """Frames being sealed and written, plus the wait from the last piece to the
        acknowledgement (the waits for the engine's next layer excluded)."""
        tail = self.record.send_end_ns - self._last_sent_ns if self.record.send_end_ns else 0
        return self._busy_ns + max(0, tail)

    def begin(self, request_id: str, layout: KVLayout, num_tokens: int) -> None:
        """Open the stream (call on the event loop); the endpoint reserves the whole size."""
        if num_tokens < 1:
            raise InvalidArgumentError("num_tokens", f"must be >= 1, got {num_tokens}")
        self.record.send_start_ns = time.monotonic_ns()
        self.state = advance(self.state, TransferState.SENDING)
        self._loop = asyncio.get_running_loop()
        self._header = header = StreamHeader(request_id, layout, num_tokens, self.compression)
        self.capability = secrets.token_bytes(CAPABILITY_BYTES)
        self.key = handoff_key(request_id, self.capability)
        self.record.num_bytes = stream_bytes(header)
        self._inline = (
            self.compression is Compression.NONE
            and frame_bytes(layout, num_tokens, self.compression) <= INLINE_SEAL_BYTES
        )
        self._task = self._loop.create_task(
            self.client.put_stream(
                self.key,
                self._frames(),
                header=header.encode(),
                total_bytes=self.record.num_bytes,
                lease_s=self.lease_s,
            ),
            name=f"kv-put-{request_id}",
        )

    def send_layer(self, layer: int, k: KVArray, v: KVArray) -> None:
        """The layer hook (engine thread): take the layer, queue it. Never raises."""
        start = time.monotonic_ns()
        if self._error is None:
            try:
                self._take(layer, k, v)
            except Exception as err:  # raising here would fail the engine's whole batch
                self._error = err
        self.record.hooked(start, time.monotonic_ns())

    def _take(self, layer: int, k: KVArray, v: KVArray) -> None:
        h, loop = self._header, self._loop
        if self.state is not TransferState.SENDING or h is None or loop is None:
            raise KVTransferError(f"send_layer on a sender that is {self.state.name}")
        check_layer(h.layout, h.num_tokens, layer, k, v, self._seen)
        corrupt = not self._seen and self.faults is not None and self.faults.corrupts(h.request_id)
        self._seen.add(layer)
        copy = LayerCopy.take(layer, k, v)
        seal = functools.partial(
            copy.seal, self.client.chunk_bytes, self.compression, corrupt=corrupt
        )
        # A small frame is sealed by the event loop when it sends it: its CRCs take ~0.1 ms
        # there, less than a hand-over between threads on a busy machine. Measured, paired,
        # a 1K hand-off (2 MiB frames) ran 1.09-1.21x as fast so, 2K 1.05x. A large one is
        # sealed at once, in the sealing thread, so that the seals run ahead of the wire and
        # the loop (which serves every other request too) never spends milliseconds on one.
        item: Sealing = seal if self._inline else self._sealer.submit(seal)
        loop.call_soon_threadsafe(self._queue.put_nowait, item)
        if len(self._seen) == h.layout.num_layers:
            # The last layer: end the stream right behind it, so that the endpoint holds the
            # whole hand-off (and a prefetching reader its end) while the engine still ends
            # its step, instead of after ``commit``.
            loop.call_soon_threadsafe(self._queue.put_nowait, None)
            self._end_queued = True

    async def _frames(self) -> AsyncGenerator[Piece, None]:
        """The Put stream's data: each frame's pieces, in the order the layers were taken, as
        soon as they are sealed (checksums, int8)."""
        f, rid = self.faults, self._header.request_id if self._header else ""
        stall = f.stall_after_layers if f is not None and f.stalls(rid) else None
        sent = 0
        # At once, before any layer: the first chunk (key, header, size) opens the write at
        # the endpoint, so a reader told of the hand-off (a prefetch) finds it there.
        yield b"", 0  # CRC-32 of nothing
        try:
            while (sealed := await self._queue.get()) is not None:
                if stall is not None and sent >= stall:
                    await asyncio.Event().wait()  # until the commit times out or we are killed
                start = time.monotonic_ns()
                if not isinstance(sealed, Future):
                    pieces = sealed()
                elif sealed.done():
                    pieces = sealed.result()
                else:
                    pieces = await asyncio.wrap_future(sealed)
                self._busy_ns += time.monotonic_ns() - start
                sent += 1
                for piece in pieces:
                    start = time.monotonic_ns()
                    yield piece  # resumes once gRPC has taken the piece
                    self._last_sent_ns = time.monotonic_ns()
                    self._busy_ns += self._last_sent_ns - start
        finally:
            while not self._queue.empty():  # seals not yet started are dropped
                if isinstance(left := self._queue.get_nowait(), Future):
                    left.cancel()

    def planned(self) -> KVLocation:
        h = self._header
        if h is None:
            raise KVTransferError("planned() before begin()")
        return h.location(
            self.kind,
            num_bytes=self.record.num_bytes,
            address=self.client.address,
            key=self.key,
            capability=self.capability,
        )

    def _finish(self) -> KVLocation:
        h = self._header
        if self.state is not TransferState.SENDING or h is None:
            raise KVTransferError(f"finish on a sender that is {self.state.name}")
        if self._error is not None:
            raise KVTransferError(f"{self.kind} send of {h.request_id!r} failed: {self._error}")
        missing = missing_layers(h.layout, self._seen)
        if missing:
            raise KVTransferError(f"KV layers {missing} of {h.request_id!r} were never sent")
        # Every layer was taken, so the last one queued the end of the stream behind itself.
        return self.planned()

    async def commit(self, timeout_s: float) -> KVLocation:
        """Wait (at most ``timeout_s``) until the endpoint holds the whole stream (its last
        layer ended it)."""
        descriptor = self._finish()
        task = self._task
        if task is None:
            raise KVTransferError("commit before begin")
        try:
            await asyncio.wait_for(task, timeout_s)  # cancels the stream on timeout
        except TimeoutError:
            raise KVTransferError(
                f"{self.kind} hand-off of {descriptor.request_id!r} to {self.client.address} "
                f"not committed within {timeout_s:.3g} s"
            ) from None
        self.record.send_end_ns = time.monotonic_ns()
        self.state = advance(self.state, TransferState.SENT)
        return descriptor

    async def discard(self) -> None:
        """Free what the hand-off left at the endpoint (best effort: an entry's lease ends it
        otherwise). Idempotent.

        A stream still missing layers is cut off: the store drops the partial entry. One whose
        last layer was taken ends on its own (``_take``), committed or not (a request that
        finished at its first token never commits): it is let finish, within the client's
        timeout, and its entry deleted. Cutting it off instead could race with the endpoint
        committing it, leaving an entry nobody reads until its lease ends."""
        task, self._task = self._task, None
        if task is not None and not task.done() and not self._end_queued:
            task.cancel()
        if task is not None:
            # Discarding: the stream's own outcome no longer matters.
            with contextlib.suppress(asyncio.CancelledError, TimeoutError, PdServeError):
                await asyncio.wait_for(task, self.client.timeout_s)
        if self._end_queued:
            self._end_queued = False
            try:
                await self.client.delete(self.key)
            except PdServeError as err:
                logger.warning("could not delete %s at %s: %s", self.key, self.client.address, err)
        if not self.state.terminal:
            self.state = advance(self.state, TransferState.FAILED)
