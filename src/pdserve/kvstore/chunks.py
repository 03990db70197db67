"""The KVChunk stream format of ``pdserve.v1.KVStore``, both directions.

A payload travels as chunks ``seq = 0, 1, 2, ...``, each with the CRC-32 of its data; the first
carries the key, the header and the total size, the last has ``last = true``. ``split`` writes
such a stream and ``ChunkAssembler`` reads one back, refusing gaps, repeats, bad checksums,
oversize streams and streams that end without their last chunk.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

from pdserve.errors import CapacityError, InvalidArgumentError, KVTransferError
from pdserve.v1 import kvstore_pb2

DEFAULT_CHUNK_BYTES = 1024 * 1024


def split(
    data: bytes,
    *,
    key: str = "",
    header: bytes = b"",
    lease_s: float = 0.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[kvstore_pb2.KVChunk]:
    """``data`` as a chunk stream; always at least one chunk (the last), even for no data."""
    if chunk_bytes < 1:
        raise InvalidArgumentError("chunk_bytes", f"must be >= 1, got {chunk_bytes}")
    view = memoryview(data)
    total = len(header) + len(data)
    starts = range(0, len(data), chunk_bytes) if data else range(1)
    for seq, start in enumerate(starts):
        piece = bytes(view[start : start + chunk_bytes])
        chunk = kvstore_pb2.KVChunk(
            seq=seq,
            data=piece,
            crc32=zlib.crc32(piece),
            last=start + chunk_bytes >= len(data),
        )
        if seq == 0:
            chunk.key = key
            chunk.header = header
            chunk.lease_s = lease_s
            chunk.total_bytes = total
        yield chunk


class ChunkAssembler:
    """Checks and concatenates a chunk stream; ``limit_bytes`` bounds what it accepts.

    ``feed`` every chunk in arrival order, then ``finish()`` returns the data. The first
    chunk's ``key``, ``header``, ``lease_s`` and ``total_bytes`` are kept as attributes.
    """

    def __init__(self, *, limit_bytes: int | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.key = ""
        self.header = b""
        self.lease_s = 0.0
        self.total_bytes = 0
        self.num_chunks = 0
        self._parts: list[bytes] = []
        self._size = 0
        self._done = False

    @property
    def num_bytes(self) -> int:
        """Header + data bytes received so far."""
        return len(self.header) + self._size

    def feed(self, chunk: kvstore_pb2.KVChunk) -> None:
        if self._done:
            raise InvalidArgumentError("seq", f"chunk {chunk.seq} arrived after the last chunk")
        if chunk.seq != self.num_chunks:
            raise InvalidArgumentError("seq", f"expected chunk {self.num_chunks}, got {chunk.seq}")
        if zlib.crc32(chunk.data) != chunk.crc32:
            raise KVTransferError(f"chunk {chunk.seq} of {self.key!r} failed its CRC-32 check")
        if self.num_chunks == 0:
            self.key = chunk.key
            self.header = chunk.header
            self.lease_s = chunk.lease_s
            self.total_bytes = chunk.total_bytes
        self.num_chunks += 1
        self._parts.append(chunk.data)
        self._size += len(chunk.data)
        if self.total_bytes and self.num_bytes > self.total_bytes:
            raise InvalidArgumentError(
                "total_bytes", f"stream carries more than the announced {self.total_bytes} bytes"
            )
        if self.limit_bytes is not None and self.num_bytes > self.limit_bytes:
            raise CapacityError(
                f"stream exceeds the {self.limit_bytes}-byte limit of this receiver"
            )
        self._done = chunk.last

    def finish(self) -> bytes:
        """The data, once the last chunk arrived and the size matches the announced one."""
        if not self._done:
            raise KVTransferError(
                f"chunk stream of {self.key!r} ended after {self.num_chunks} chunks without the "
                "last one"
            )
        if self.total_bytes and self.num_bytes != self.total_bytes:
            raise KVTransferError(
                f"chunk stream of {self.key!r} carried {self.num_bytes} bytes, "
                f"announced {self.total_bytes}"
            )
        data = b"".join(self._parts)
        self._parts = [data]
        return data
