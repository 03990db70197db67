"""The layout of one KV shared-memory segment, and reading and writing it.

Segment layout (little-endian, offsets relative to the segment's start)::

    0   b"PDSHMKV2"  magic
    8   u32 state    0 = being written, 1 = sealed (the writer's commit point)
    12  u32 header_len
    16  u32 num_layers
    20  u32 reserved
    24  header       ``KVPayload.header_bytes()`` (layout + num_tokens, JSON)
    T   u64[num_layers]  XXH3-64 of each layer's bytes (T = header end, 64-aligned)
    D   layer 0 K, layer 0 V, layer 1 K, ...            (D = table end, 64-aligned)

Each K or V is ``[num_tokens, kv_heads, head_dim]`` in the layout's dtype. The segment is
self-describing, so a reader that got only a ``KVHandle`` (name, offset, length) can use it.

Segments are plain ``os.open`` files in ``/dev/shm`` mapped with ``mmap`` (what ``shm_open``
does), not ``multiprocessing.shared_memory``: its resource tracker would unlink segments that
another process now owns and warn about "leaked" ones at exit. Space is reserved with
``posix_fallocate`` on creation, so a full ``/dev/shm`` is a ``CapacityError`` then, not a
SIGBUS in the middle of a forward pass.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.kv_payload import DTYPES, KVLayout, KVPayload, parse_header
from pdserve.errors import CapacityError, DuplicateRequestError, KVTransferError
from pdserve.transfer.checksum import layer_checksum

_MAGIC = b"PDSHMKV2"
_PREAMBLE = struct.Struct("<8sIIII")  # magic, state, header_len, num_layers, reserved
_STATE_OFFSET = 8
_WRITING, _SEALED = 0, 1
_ALIGN = 64


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True, slots=True)
class SegmentGeometry:
    """Where everything lies in the segment of one payload."""

    header_len: int
    num_layers: int
    layer_bytes: int
    """K and V of one layer."""

    @classmethod
    def of(cls, header_len: int, layout: KVLayout, num_tokens: int) -> SegmentGeometry:
        return cls(header_len, layout.num_layers, num_tokens * layout.bytes_per_token_per_layer)

    @property
    def table_offset(self) -> int:
        return _align(_PREAMBLE.size + self.header_len)

    @property
    def data_offset(self) -> int:
        return _align(self.table_offset + 8 * self.num_layers)

    @property
    def total(self) -> int:
        return self.data_offset + self.num_layers * self.layer_bytes

    def layer_offset(self, layer: int) -> int:
        return self.data_offset + layer * self.layer_bytes


# -- writing ---------------------------------------------------------------------------------
def create(path: Path, size: int) -> int:
    """Create the segment file (exclusively) and reserve its ``size`` bytes; the open fd.

    ``map_for_writing`` maps it afterwards (possibly in another thread: pre-faulting the
    pages of a large segment takes about as long as copying into them)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise DuplicateRequestError(f"shm segment {path.name!r} already exists") from None
    try:
        _reserve(fd, size)
    except BaseException:
        os.close(fd)
        unlink(path)
        raise
    return fd


def map_for_writing(fd: int, header: bytes, geom: SegmentGeometry) -> mmap.mmap:
    """Map the file ``create`` made, page tables filled in (``MAP_POPULATE``), write the
    preamble and header; closes ``fd`` (the mapping keeps the memory, the name the segment).

    Without the pre-faulting, the layer copies would take one page fault per 4 KiB page
    (about 1 us each: 0.1 s for a 400 MB payload, twice the copy itself)."""
    try:
        mm = mmap.mmap(fd, geom.total, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    _PREAMBLE.pack_into(mm, 0, _MAGIC, _WRITING, len(header), geom.num_layers, 0)
    mm[_PREAMBLE.size : _PREAMBLE.size + len(header)] = header
    return mm


def _reserve(fd: int, size: int) -> None:
    """Allocate ``size`` bytes now, so that running out of shm fails here, not as SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise CapacityError(f"shared memory is full: cannot reserve {size} bytes") from err
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a file system without fallocate: size only


def seal(mm: mmap.mmap, geom: SegmentGeometry, checksums: tuple[int, ...]) -> None:
    """Write the checksum table, then flip the state word: the segment is complete."""
    struct.pack_into(f"<{len(checksums)}Q", mm, geom.table_offset, *checksums)
    struct.pack_into("<I", mm, _STATE_OFFSET, _SEALED)


def close_mapping(mm: mmap.mmap | None) -> None:
    if mm is None:
        return
    # A BufferError means a tensor view over the mapping is still referenced (e.g. by a
    # recorded exception's traceback); the mapping goes when that view does.
    with contextlib.suppress(BufferError):
        mm.close()


def unlink(path: Path) -> None:
    # Not found: the other side (or the janitor) already removed it.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# -- reading ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """What a sealed segment says about itself."""

    layout: KVLayout
    num_tokens: int
    geom: SegmentGeometry
    checksums: tuple[int, ...]


def read_header(fd: int, offset: int, name: str) -> SegmentHeader:
    """Preamble, header and checksum table of the sealed segment at ``offset`` of ``fd``."""
    magic, state, header_len, num_layers, _ = _PREAMBLE.unpack(
        _pread_exact(fd, _PREAMBLE.size, offset)
    )
    if magic != _MAGIC:
        raise KVTransferError(f"shm segment {name!r} is not a pdserve KV segment")
    if state != _SEALED:
        raise KVTransferError(f"shm segment {name!r} is not sealed (its writer never finished)")
    layout, num_tokens = parse_header(_pread_exact(fd, header_len, offset + _PREAMBLE.size))
    if num_layers != layout.num_layers:
        raise KVTransferError(
            f"shm segment {name!r}: {num_layers} layers, its header says {layout.num_layers}"
        )
    geom = SegmentGeometry.of(header_len, layout, num_tokens)
    if os.fstat(fd).st_size < offset + geom.total:
        raise KVTransferError(f"shm segment {name!r} is truncated")
    table = _pread_exact(fd, 8 * num_layers, offset + geom.table_offset)
    return SegmentHeader(layout, num_tokens, geom, struct.unpack(f"<{num_layers}Q", table))


def read_payload(
    fd: int, offset: int, head: SegmentHeader, checksums: tuple[int, ...], deadline: float
) -> KVPayload:
    """Every layer, as views over a private mapping of the segment, each checked against its
    XXH3-64 (``deadline``, ``time.monotonic``, checked between layers).

    No copy: the payload's K and V ``[num_tokens, kvh, hd]`` are views over the mapping, which
    they keep alive; the engine's import is the only copy into its blocks. The mapping is
    ``MAP_PRIVATE`` (writable views, and a stray write stays in this process). Unlink the
    segment before calling this: then no one can open it anew, and its writer closed its own
    mapping when it sealed, so the bytes checked are the bytes imported.
    """
    geom, layout, n = head.geom, head.layout, head.num_tokens
    if len(checksums) != geom.num_layers:
        raise KVTransferError(f"{len(checksums)} layer checksums for {geom.num_layers} layers")
    size = geom.layer_bytes
    # mmap's offset must be page-aligned: map from 0 and index from ``offset``.
    mm = mmap.mmap(
        fd, offset + geom.total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
    )
    with memoryview(mm) as whole:
        for i in range(geom.num_layers):
            if time.monotonic() > deadline:
                raise KVTransferError(f"shm read timed out at layer {i} of {geom.num_layers}")
            start = offset + geom.layer_offset(i)
            with whole[start : start + size] as part:
                if layer_checksum(part) != checksums[i]:
                    raise KVTransferError(f"KV layer {i} failed its checksum")
    body = torch.frombuffer(mm, dtype=torch.uint8, count=geom.num_layers * size,
                            offset=offset + geom.data_offset)  # fmt: skip
    dtype, shape = DTYPES[layout.dtype], (n, layout.num_kv_heads, layout.head_dim)
    half = size // 2
    layers = [body[i * size : (i + 1) * size] for i in range(geom.num_layers)]
    return KVPayload(
        layout,
        n,
        tuple(t[:half].view(dtype).view(shape) for t in layers),
        tuple(t[half:].view(dtype).view(shape) for t in layers),
    )


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise KVTransferError(f"shm segment ends at {offset + len(data)}; needed {offset + n}")
    return data
