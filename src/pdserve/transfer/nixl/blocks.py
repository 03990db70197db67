"""Fixed-size blocks of a registered pool: allocation, runs, and the byte ranges of a payload.

A hand-off's payload is one byte string laid over a list of blocks, in order::

    u32 header_len | StreamHeader | pad to 64 | marks: num_layers x 8 bytes | pad to 64 |
    frame of layer 0 | frame of layer 1 | ...

(``stream.frames``: each frame its header, CRC-32, K and V; every frame of a payload has the
same size, so layer ``i`` starts at ``frames_at + i * frame_size`` whatever order the layers
come in.) Layer ``i``'s mark is ``layer_mark(capability, i)``, written once its frame is in:
a reader that follows the writer polls the marks, and a mark left in the blocks by an earlier
hand-off (another capability) never matches.

``BlockAllocator`` prefers one contiguous run, so that most payloads are one descriptor on
each side; ``runs`` coalesces consecutive ids; ``pair_ranges`` cuts two
layouts of the same bytes (the remote blocks, the local ones) at every boundary of either,
giving the equal-length descriptor pairs a READ takes.

Torch-free.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Sequence

from pdserve.errors import CapacityError, InvalidArgumentError

LEN_PREFIX = struct.Struct("<I")
FRAMES_ALIGN = 64
MARK_BYTES = 8
"""Bytes of one layer's ready mark."""


def _align(n: int) -> int:
    return -(-n // FRAMES_ALIGN) * FRAMES_ALIGN


def marks_offset(header_len: int) -> int:
    """Where the layers' ready marks start in a payload whose header is ``header_len`` bytes."""
    return _align(LEN_PREFIX.size + header_len)


def frames_offset(header_len: int, num_layers: int) -> int:
    """Where the first frame starts."""
    return _align(marks_offset(header_len) + num_layers * MARK_BYTES)


def payload_bytes(header_len: int, num_layers: int, frame_size: int) -> int:
    return frames_offset(header_len, num_layers) + num_layers * frame_size


def layer_mark(capability: bytes, layer: int) -> bytes:
    """Layer ``layer``'s ready mark in the hand-off of ``capability``: keyed by it, so that
    no other hand-off's mark (nor zeros) passes for it."""
    return hashlib.blake2b(
        layer.to_bytes(4, "little"), key=capability, digest_size=MARK_BYTES
    ).digest()


def blocks_for(num_bytes: int, block_bytes: int) -> int:
    return max(1, -(-num_bytes // block_bytes))


def runs(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """``(first block, count)`` of each run of consecutive ids, in order."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def ranges(
    blocks: Sequence[int], base: int, block_bytes: int, length: int, start: int = 0
) -> list[tuple[int, int]]:
    """``(address, length)`` of bytes ``start..start+length`` of the payload laid over
    ``blocks`` (runs coalesced) in a pool of ``block_bytes`` blocks at ``base``."""
    out: list[tuple[int, int]] = []
    end, at = start + length, 0  # ``at``: the payload offset where the run starts
    for first, count in runs(blocks):
        if at >= end:
            break
        lo, hi = max(at, start), min(at + count * block_bytes, end)
        if lo < hi:
            out.append((base + first * block_bytes + lo - at, hi - lo))
        at += count * block_bytes
    if at < end:
        raise InvalidArgumentError("blocks", f"{len(blocks)} blocks hold less than {end} bytes")
    return out


def pair_ranges(
    local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Equal-length ``(local, remote)`` pieces covering the same bytes of both layouts."""
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise InvalidArgumentError("ranges", "the two layouts do not hold as many bytes")
    out = []
    li = ri = 0
    lo = ro = 0  # offsets into the current range of each side
    while li < len(local) and ri < len(remote):
        (la, ln), (ra, rn) = local[li], remote[ri]
        take = min(ln - lo, rn - ro)
        out.append(((la + lo, take), (ra + ro, take)))
        lo += take
        ro += take
        if lo == ln:
            li, lo = li + 1, 0
        if ro == rn:
            ri, ro = ri + 1, 0
    return out


Pair = tuple[tuple[int, int], tuple[int, int]]


def cut_pieces(pairs: Sequence[Pair], piece_bytes: int) -> list[tuple[list[Pair], int]]:
    """``pairs`` in groups of ``piece_bytes`` (the last one shorter; a pair split where a
    group ends), each with the payload offset where it ends: one transfer each, posted
    together, so that the first pieces can be checked while the later ones are on the wire.
    ``piece_bytes`` 0: one group."""
    total = sum(n for (_, n), _ in pairs)
    if piece_bytes <= 0:
        return [(list(pairs), total)]
    groups: list[tuple[list[Pair], int]] = []
    current: list[Pair] = []
    size = done = 0
    for (la, n), (ra, _) in pairs:
        off = 0
        while off < n:
            take = min(n - off, piece_bytes - size)
            current.append(((la + off, take), (ra + off, take)))
            size, off, done = size + take, off + take, done + take
            if size == piece_bytes:
                groups.append((current, done))
                current, size = [], 0
    if current:
        groups.append((current, done))
    return groups


class BlockAllocator:
    """Block ids ``0..num_blocks-1``, taken and given back; thread-safe (the layer hook runs
    on the engine thread, the rest in the event loop)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise InvalidArgumentError("num_blocks", f"must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return self._num_free

    def take(self, count: int) -> list[int]:
        """``count`` free ids: the first contiguous run that fits, else the lowest free ids;
        ``CapacityError`` when fewer are free."""
        if count < 1:
            raise InvalidArgumentError("count", f"must be >= 1, got {count}")
        with self._lock:
            if count > self._num_free:
                raise CapacityError(
                    f"NIXL block pool: {count} blocks asked, {self._num_free} of "
                    f"{self.num_blocks} free"
                )
            start = self._free.find(b"\x01" * count)
            if start >= 0:
                ids = list(range(start, start + count))
            else:
                ids = [i for i, f in enumerate(self._free) if f][:count]
            for i in ids:
                self._free[i] = 0
            self._num_free -= count
            return ids

    def give_back(self, ids: Sequence[int]) -> None:
        with self._lock:
            for i in ids:
                if self._free[i]:
                    raise InvalidArgumentError("ids", f"block {i} is free already")
                self._free[i] = 1
            self._num_free += len(ids)
