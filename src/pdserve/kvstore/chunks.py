"""The KVChunk stream format of ``pdserve.v1.KVStore``, both directions.

A payload travels as chunks ``seq = 0, 1, 2, ...``, each with the CRC-32 of its data; the first
carries the key, the header and the total size, the last has ``last = true``. ``split`` writes
such a stream and ``ChunkAssembler`` reads one back (``ChunkReader`` checks one piece by piece
without keeping it), refusing gaps, repeats, bad checksums, oversize streams and streams that
end without their last chunk.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pdserve.errors import CapacityError, InvalidArgumentError, KVTransferError
from pdserve.kvstore.crc import fast_crc32
from pdserve.kvstore.wire import Buffer, Chunk, received_as

DEFAULT_CHUNK_BYTES = 1024 * 1024


def split(
    data: bytes | bytearray | memoryview,
    *,
    key: str = "",
    header: bytes = b"",
    lease_s: float = 0.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    cache: bool = False,
) -> Iterator[Chunk]:
    """``data`` as a chunk stream; always at least one chunk (the last), even for no data."""
    if chunk_bytes < 1:
        raise InvalidArgumentError("chunk_bytes", f"must be >= 1, got {chunk_bytes}")
    view = memoryview(data).cast("B")
    total = len(header) + len(view)
    starts = range(0, len(view), chunk_bytes) if len(view) else range(1)
    for seq, start in enumerate(starts):
        chunk = data_chunk(seq, view[start : start + chunk_bytes], start + chunk_bytes >= len(view))
        if seq == 0:
            first_chunk_fields(chunk, key, header, lease_s, total, cache)
        yield chunk


def split_parts(
    parts: Sequence[tuple[Buffer, int | None]],
    *,
    key: str = "",
    header: bytes = b"",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[Chunk]:
    """Data kept in pieces as a chunk stream (``chunk_pieces``).

    Pieces received as the data chunks of a ``ChunkSequence`` stream (the data from seq 1 on,
    between a first chunk that only opens the stream and an empty last one: how pdserve's
    writers put) go out the same way, each as the chunk it came in: then the wire codec sends
    the received messages on unchanged (``wire.encode``). Other pieces go out from seq 0, the
    first carrying the stream's fields, the last ``last``."""
    pieces = chunk_pieces(parts, chunk_bytes) or [(b"", None)]
    total = len(header) + sum(len(p) for p, _ in pieces)
    first, first_crc = pieces[0]
    if first_crc is not None and received_as(data_chunk(1, first, False, first_crc)):
        sequence = ChunkSequence(key, header, total_bytes=total)
        yield sequence.chunk(b"", 0)
        for piece, crc in pieces:
            yield sequence.chunk(piece, crc)
        yield sequence.end()
        return
    for seq, (piece, crc) in enumerate(pieces):
        chunk = data_chunk(seq, piece, seq == len(pieces) - 1, crc)
        if seq == 0:
            first_chunk_fields(chunk, key, header, 0.0, total)
        yield chunk


def chunk_pieces(
    parts: Sequence[tuple[Buffer, int | None]], chunk_bytes: int
) -> list[tuple[Buffer, int | None]]:
    """The data of ``parts`` as chunk-sized pieces: a part whose CRC-32 is known and that fits
    a chunk, give or take 1/64 of one, goes out as it is (no copy, no second checksum); others
    are split (views); empty parts are left out.

    The margin lets a layer frame's first piece (a full chunk of K behind the frame's 28-byte
    header, ``transfer.stream.frames``) leave as it came, so a reader can keep K without a copy."""
    pieces: list[tuple[Buffer, int | None]] = []
    for data, crc in parts:
        if crc is not None and len(data) <= chunk_bytes + chunk_bytes // 64:
            pieces.append((data, crc))
            continue
        view = memoryview(data)
        pieces += [(view[i : i + chunk_bytes], None) for i in range(0, len(view), chunk_bytes)]
    return [p for p in pieces if len(p[0])]


def data_chunk(
    seq: int, piece: Buffer, last: bool, crc32: int | None = None, lead: bytes = b""
) -> Chunk:
    """One chunk carrying ``lead`` then ``piece`` (not copied: the wire codec copies them
    once, when gRPC sends the chunk; keep them unchanged until then) and their CRC-32
    (``crc32`` if the caller computed it already)."""
    crc = fast_crc32(piece, fast_crc32(lead)) if crc32 is None else crc32
    return Chunk(seq=seq, data=piece, crc32=crc, last=last, lead=lead)


@dataclass(slots=True)
class ChunkSequence:
    """Numbers the chunks of a stream whose pieces come one at a time, putting the stream's
    own fields (``first_chunk_fields``) on the first; ``end()`` is an empty last chunk, so
    that no piece is held back waiting to learn whether it is the last."""

    key: str
    header: bytes = b""
    lease_s: float = 0.0
    total_bytes: int = 0
    cache: bool = False
    seq: int = 0

    def chunk(self, piece: Buffer, crc32: int | None = None, lead: bytes = b"") -> Chunk:
        return self._next(piece, False, crc32, lead)

    def end(self) -> Chunk:
        return self._next(b"", True, None)

    def _next(self, piece: Buffer, last: bool, crc32: int | None, lead: bytes = b"") -> Chunk:
        chunk = data_chunk(self.seq, piece, last, crc32, lead)
        if self.seq == 0:
            first_chunk_fields(
                chunk, self.key, self.header, self.lease_s, self.total_bytes, self.cache
            )
        self.seq += 1
        return chunk


def first_chunk_fields(
    chunk: Chunk,
    key: str,
    header: bytes,
    lease_s: float,
    total_bytes: int,
    cache: bool = False,
) -> None:
    """Set what only the first chunk of a stream carries."""
    chunk.key = key
    chunk.header = header
    chunk.lease_s = lease_s
    chunk.total_bytes = total_bytes
    chunk.cache = cache


class ChunkReader:
    """Checks a chunk stream piece by piece without keeping it; ``limit_bytes`` bounds it.

    ``feed`` every chunk in arrival order: it returns the chunk's data once seq and CRC-32
    check out. The first chunk's ``key``, ``header``, ``lease_s``, ``total_bytes`` and
    ``cache`` are kept as attributes; ``done`` turns true with the last chunk.
    """

    def __init__(self, *, limit_bytes: int | None = None, verify: bool = True) -> None:
        self.limit_bytes = limit_bytes
        self.verify = verify
        """False: the caller checks the CRCs itself (``CrcPipeline``)."""
        self.key = ""
        self.header = b""
        self.lease_s = 0.0
        self.total_bytes = 0
        self.cache = False
        self.num_chunks = 0
        self.num_data_bytes = 0
        self.done = False

    @property
    def num_bytes(self) -> int:
        """Header + data bytes received so far."""
        return len(self.header) + self.num_data_bytes

    def feed(self, chunk: Chunk) -> Buffer:
        if self.done:
            raise InvalidArgumentError("seq", f"chunk {chunk.seq} arrived after the last chunk")
        if chunk.seq != self.num_chunks:
            raise InvalidArgumentError("seq", f"expected chunk {self.num_chunks}, got {chunk.seq}")
        if self.verify and fast_crc32(chunk.data) != chunk.crc32:
            raise KVTransferError(f"chunk {chunk.seq} of {self.key!r} failed its CRC-32 check")
        if self.num_chunks == 0:
            self.key = chunk.key
            self.header = chunk.header
            self.lease_s = chunk.lease_s
            self.total_bytes = chunk.total_bytes
            self.cache = chunk.cache
        self.num_chunks += 1
        self.num_data_bytes += len(chunk.data)
        if self.total_bytes and self.num_bytes > self.total_bytes:
            raise InvalidArgumentError(
                "total_bytes", f"stream carries more than the announced {self.total_bytes} bytes"
            )
        if self.limit_bytes is not None and self.num_bytes > self.limit_bytes:
            raise CapacityError(
                f"stream exceeds the {self.limit_bytes}-byte limit of this receiver"
            )
        self.done = chunk.last
        return chunk.data

    def check_complete(self) -> None:
        """``KVTransferError`` unless the last chunk came and the size is the announced one."""
        if not self.done:
            raise KVTransferError(
                f"chunk stream of {self.key!r} ended after {self.num_chunks} chunks without the "
                "last one"
            )
        if self.total_bytes and self.num_bytes != self.total_bytes:
            raise KVTransferError(
                f"chunk stream of {self.key!r} carried {self.num_bytes} bytes, "
                f"announced {self.total_bytes}"
            )


class CrcPipeline:
    """Checks chunks' CRC-32s as the stream goes on: at once, or in worker threads.

    A chunk that just arrived is in cache, where ``fast_crc32`` runs at ~80 GB/s: a 1 MiB
    chunk takes ~15 us, far less than handing it to a thread (~100 us of submission and
    wake-ups, measured). Chunks of ``INLINE_BYTES`` or more are checked in worker threads
    (``fast_crc32`` releases the GIL), up to ``DEPTH`` at a time, so the event loop keeps
    receiving. The data must not be trusted before ``drain()`` returned; ``cancel()`` drops
    what is still pending (the stream failed anyway).
    """

    INLINE_BYTES = 4 * 1024 * 1024
    DEPTH = 4

    def __init__(self, key: str = "") -> None:
        self.key = key
        self._pending: deque[tuple[int, asyncio.Future[int], int]] = deque()

    async def check(self, chunk: Chunk) -> None:
        """Check ``chunk`` (now, or in a thread); raises for an earlier one that failed."""
        if len(chunk.data) < self.INLINE_BYTES:
            self._compare(chunk.seq, fast_crc32(chunk.data), chunk.crc32)
            return
        while len(self._pending) >= self.DEPTH:
            await self._next()
        future = asyncio.get_running_loop().run_in_executor(None, fast_crc32, chunk.data)
        self._pending.append((chunk.seq, future, chunk.crc32))

    async def drain(self) -> None:
        """Wait for every pending check; ``KVTransferError`` if one failed."""
        while self._pending:
            await self._next()

    def cancel(self) -> None:
        for _, future, _ in self._pending:
            future.cancel()  # a check already running finishes in its thread, unread
        self._pending.clear()

    async def _next(self) -> None:
        seq, future, expected = self._pending.popleft()
        self._compare(seq, await future, expected)

    def _compare(self, seq: int, got: int, expected: int) -> None:
        if got != expected:
            raise KVTransferError(f"chunk {seq} of {self.key!r} failed its CRC-32 check")


class ChunkAssembler(ChunkReader):
    """A ``ChunkReader`` that also keeps the data: ``finish()`` returns it."""

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[Buffer] = []

    def feed(self, chunk: Chunk) -> Buffer:
        data = super().feed(chunk)
        self._parts.append(data)
        return data

    def finish(self) -> bytes:
        """The data, once the last chunk arrived and the size matches the announced one."""
        self.check_complete()
        data = b"".join(self._parts)
        self._parts = [data]
        return data
