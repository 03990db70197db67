"""How a KV store entry lies in one Mooncake Store object.

::

    b"PDMCKV1\\n" | u32 header_len | u32 flags | header | data

A writer's pieces follow the data: ``u64`` length of each, then their ``u32`` count
(``ObjectWriter``, ``pieces_of``), so that a reader hands the pieces on as the writer cut
them. ``header`` and ``data`` are what a ``KVStore`` entry holds (the layer stream's header and
frames for a hand-off; nothing and a ``KVPayload.to_bytes()`` for a prefix chunk). ``flags``
bit 0 marks a cache entry. The data carries its own checks (each frame's CRC-32, the payload's
trailing CRC-32), so an object adds none: a reader verifies end to end what the writer sealed.
"""

from __future__ import annotations

import struct

import numpy as np

from pdserve.errors import KVTransferError
from pdserve.kvstore.client import Bytes

MAGIC = b"PDMCKV1\n"
_HEAD = struct.Struct("<8sII")
HEAD_BYTES = _HEAD.size
FLAG_CACHE = 1


def object_bytes(header_len: int, data_len: int) -> int:
    """An object's size for a header and data of these lengths."""
    return HEAD_BYTES + header_len + data_len


def encode_head(header: bytes, *, cache: bool) -> bytes:
    """The object's first bytes: the fixed head and the header."""
    return _HEAD.pack(MAGIC, len(header), FLAG_CACHE if cache else 0) + header


def decode_head(key: str, raw: memoryview) -> tuple[bytes, int]:
    """``(header, offset of the data)`` of an object; a foreign or cut object raises
    ``KVTransferError`` naming the key."""
    if len(raw) < HEAD_BYTES:
        raise KVTransferError(
            f"Mooncake object {key!r} is {len(raw)} bytes, not a pdserve KV entry"
        )
    magic, header_len, _flags = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise KVTransferError(f"Mooncake object {key!r} is not a pdserve KV entry")
    end = HEAD_BYTES + header_len
    if end > len(raw):
        raise KVTransferError(f"Mooncake object {key!r} is cut inside its header")
    return bytes(raw[HEAD_BYTES:end]), end


_TABLE_ENTRY = struct.Struct("<Q")
_TABLE_TAIL = struct.Struct("<I")


class ObjectWriter:
    """One object being gathered: head, header, the pieces' bytes, then the table of piece
    lengths and its count (``objects`` describes the head). The pieces are kept as they came,
    not copied: the object is put from all of them at once (``Library.put_parts``), so each
    piece must stay as it is until the put has ended (the writers' pieces are their own
    copies of the layers)."""

    def __init__(self, header: bytes, data_bytes: int, *, cache: bool) -> None:
        self.expected = data_bytes  # -1: unknown
        self.parts: list[np.ndarray] = [_array(encode_head(header, cache=cache))]
        self.pieces: list[int] = []

    def write(self, data: Bytes, lead: bytes = b"") -> None:
        piece = memoryview(data).cast("B")
        n = len(lead) + len(piece)
        if not n:
            return
        if lead:
            self.parts.append(_array(bytes(lead)))
        if len(piece):
            self.parts.append(_array(piece))
        self.pieces.append(n)

    @property
    def data_bytes(self) -> int:
        return sum(self.pieces)

    def finish(self, key: str) -> list[np.ndarray]:
        """The object's parts, in order, its table last."""
        data = self.data_bytes
        if self.expected >= 0 and data != self.expected:
            raise KVTransferError(
                f"put {key!r}: the stream announced {self.expected} bytes and sent {data}"
            )
        table = b"".join(_TABLE_ENTRY.pack(n) for n in self.pieces)
        return [*self.parts, _array(table + _TABLE_TAIL.pack(len(self.pieces)))]


def _array(data: Bytes) -> np.ndarray:
    """``data``'s bytes as a uint8 array over the same memory (no copy)."""
    return np.frombuffer(data, dtype=np.uint8)


def pieces_of(key: str, raw: memoryview, start: int) -> list[memoryview]:
    """The writer's pieces of an object read whole (``_ObjectWriter``)."""
    if len(raw) < start + _TABLE_TAIL.size:
        raise KVTransferError(f"Mooncake object {key!r} is cut before its table")
    (count,) = _TABLE_TAIL.unpack_from(raw, len(raw) - _TABLE_TAIL.size)
    table_at = len(raw) - _TABLE_TAIL.size - count * _TABLE_ENTRY.size
    if table_at < start:
        raise KVTransferError(f"Mooncake object {key!r} has a bad piece table")
    pieces, pos = [], start
    for i in range(count):
        (n,) = _TABLE_ENTRY.unpack_from(raw, table_at + i * _TABLE_ENTRY.size)
        if pos + n > table_at:
            raise KVTransferError(f"Mooncake object {key!r}: piece {i} runs past its data")
        pieces.append(raw[pos : pos + n])
        pos += n
    if pos != table_at:
        raise KVTransferError(f"Mooncake object {key!r}: its pieces do not cover its data")
    return pieces
