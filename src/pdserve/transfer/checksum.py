"""The checksum of one layer's bytes in a hand-off: XXH3-64.

XXH3 runs at memory speed (10+ GB/s on one core with AVX2/AVX-512), where ``zlib.crc32``
manages 0.5 to 2 GB/s; with CRC-32 on both sides the checksums, not the copies, bounded the
shm transport. It detects accidental corruption (a flipped byte, a torn write) as well as a
CRC does for this purpose; neither is a defence against a deliberate forger.
"""

from __future__ import annotations

import torch
import xxhash

Buffer = bytes | bytearray | memoryview


def layer_checksum(data: Buffer) -> int:
    """XXH3-64 of ``data`` (an unsigned 64-bit int); reads the buffer in place, no copy."""
    return int(xxhash.xxh3_64_intdigest(data))


def copy_and_checksum(dst: torch.Tensor, parts: tuple[torch.Tensor, ...], rows: int) -> int:
    """Copy ``parts`` (each ``[T, ...]``, any strides) one after the other into the
    contiguous uint8 ``dst`` and return ``layer_checksum`` of what was written.

    The copy goes ``rows`` leading rows at a time and each piece is hashed right after it is
    written, while it is still in cache: one pass over memory instead of a copy then a
    second read of everything (the hash costs a third of the copy that way, not half).
    """
    hasher = xxhash.xxh3_64()
    flat = dst.reshape(-1)
    pos = 0
    with flat.numpy().data.cast("B") as out:
        for part in parts:
            for start in range(0, part.shape[0], rows):
                piece = part[start : start + rows]
                n = piece.numel() * piece.element_size()
                flat[pos : pos + n].view(piece.dtype).view(piece.shape).copy_(piece)
                hasher.update(out[pos : pos + n])
                pos += n
    return int(hasher.intdigest())
