"""How a KV store entry lies in one Mooncake Store object.

::

    b"PDMCKV1\\n" | u32 header_len | u32 flags | header | data

``header`` and ``data`` are what a ``KVStore`` entry holds (the layer stream's header and
frames for a hand-off; nothing and a ``KVPayload.to_bytes()`` for a prefix chunk). ``flags``
bit 0 marks a cache entry. The data carries its own checks (each frame's CRC-32, the payload's
trailing CRC-32), so an object adds none: a reader verifies end to end what the writer sealed.
"""

from __future__ import annotations

import struct

from pdserve.errors import KVTransferError

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
