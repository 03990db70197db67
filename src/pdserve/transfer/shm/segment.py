"""The layout of one KV shared-memory segment, and reading and writing it.

Segment layout (little-endian, offsets relative to the segment's start)::

    0   b"PDSHMKV5"  magic
    8   u32 state    0 = being written, 1 = sealed (the writer's commit point), 2 = aborted;
                     a reused slot also 3 = claimed by its reader, 4 = free (``slots.py``)
    12  u32 header_len
    16  u32 num_layers
    20  u32 flags    1 = a reused slot: its reader releases it instead of unlinking it
    24  u64 generation  of a reused slot's hand-off (the descriptor names it); 0 otherwise
    32  16 bytes     the hand-off's capability (random; the handle carries it)
    48  header       ``KVPayload.header_bytes()`` (layout + num_tokens, JSON)
    T   u64[num_layers]  checksum of each layer (T = header end, 64-aligned): XXH3-64 over
                         the 16 bytes of XXH3-64(K) and XXH3-64(V) (``checksum.kv_checksum``)
    R   u32[num_layers]  1 once the layer and its checksum are written (R = table end)
    D   layer 0 K, layer 0 V, layer 1 K, ...            (D = marks end, 64-aligned)

Each K or V is ``[num_tokens, kv_heads, head_dim]`` in the layout's dtype. The segment is
self-describing, so a reader that got only a ``KVHandle`` (name, offset, length) can use it.

The capability is what makes a handle unforgeable: names and generations are predictable (a
pid, a hash of the request id, a counter), 128 random bits are not. A reader compares it with
the handle's before it unlinks, claims, frees or (a slot it has not mapped yet) maps anything,
and refuses a mismatch with ``CapabilityError``; the writer writes it before the magic (a new
segment) or the generation (a reused slot), so a reader that sees either sees it too.

Segments are plain ``os.open`` files in ``/dev/shm`` mapped with ``mmap`` (what ``shm_open``
does), not ``multiprocessing.shared_memory``: its resource tracker would unlink segments that
another process now owns and warn about "leaked" ones at exit. Space is reserved with
``posix_fallocate`` before the mapping (by the writer's mapper thread), so a full ``/dev/shm``
is a ``CapacityError`` then, not a SIGBUS in the middle of a forward pass.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.engine.kv_payload import DTYPES, KVLayout, KVPayload, parse_header
from pdserve.errors import CapacityError, DuplicateRequestError, KVTransferError
from pdserve.transfer.janitor import MAGIC, STATE_OFFSET, SegmentState, parse_state
from pdserve.transfer.shm.checksum import combine, in_pair, layer_checksum
from pdserve.transfer.shm.populate import Populator
from pdserve.transfer.stamp import (
    CAPABILITY_OFFSET,
    GENERATION_OFFSET,
    HEADER_OFFSET,
    capability_bytes,
    check_capability,
)

_PREAMBLE = struct.Struct("<8sIIIIQ")  # magic, state, header_len, num_layers, flags, generation
FLAG_POOLED = 1
"""The flags bit of a reused slot (``slots.py``)."""
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
        return _align(HEADER_OFFSET + self.header_len)

    @property
    def ready_offset(self) -> int:
        return self.table_offset + 8 * self.num_layers

    @property
    def data_offset(self) -> int:
        return _align(self.ready_offset + 4 * self.num_layers)

    @property
    def total(self) -> int:
        return self.data_offset + self.num_layers * self.layer_bytes

    def layer_offset(self, layer: int) -> int:
        return self.data_offset + layer * self.layer_bytes


# -- writing ---------------------------------------------------------------------------------
def create(path: Path) -> int:
    """Create the segment file (exclusively, empty); the open fd.

    ``map_for_writing`` reserves and maps it afterwards, in another thread: reserving the
    pages of a large segment takes about as long as copying into them (measured here, 28 ms
    for the 50 MB of 1K tokens of the base preset), and the caller is an event loop."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise DuplicateRequestError(f"shm segment {path.name!r} already exists") from None


def map_for_writing(
    fd: int,
    header: bytes,
    geom: SegmentGeometry,
    *,
    capacity: int = 0,
    keep_fd: bool = False,
    generation: int = 0,
    capability: bytes = b"",
) -> mmap.mmap:
    """Reserve the segment's bytes (``capacity``, at least ``geom.total``) in the file
    ``create`` made (so that a full ``/dev/shm`` fails here, ``CapacityError``, not as a
    SIGBUS on a write), map it with its page tables filled in (``MAP_POPULATE``), write the
    preamble and header; closes ``fd`` unless ``keep_fd`` (the mapping keeps the memory, the
    name the segment). On failure the caller unlinks the segment (and closes a kept fd).
    A ``generation`` (> 0) marks it a reused slot's (``slots.py``); ``capability`` is the
    hand-off's (see the module docstring).

    Without the pre-faulting, the layer copies would take one page fault per 4 KiB page
    (about 1 us each: 0.1 s for a 400 MB payload, twice the copy itself)."""
    size = max(capacity, geom.total)
    try:
        _reserve(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        if not keep_fd:
            os.close(fd)
    start(
        mm, header, geom, flags=FLAG_POOLED if generation else 0, generation=generation,
        capability=capability,
    )  # fmt: skip
    return mm


def start(
    mm: mmap.mmap,
    header: bytes,
    geom: SegmentGeometry,
    *,
    flags: int = 0,
    generation: int = 0,
    capability: bytes = b"",
) -> None:
    """Begin a hand-off in ``mm``: state WRITING, no layer marked, the capability, the
    preamble and header, and the generation last. A reused slot (``slots.py``) held an earlier
    hand-off: a reader following generation ``g`` trusts the marks and the capability only
    once it reads ``g``, so they are written before it (x86 keeps stores in order)."""
    struct.pack_into("<I", mm, STATE_OFFSET, SegmentState.WRITING)
    mm[geom.table_offset : geom.data_offset] = bytes(geom.data_offset - geom.table_offset)
    mm[CAPABILITY_OFFSET:HEADER_OFFSET] = capability_bytes(capability)
    old = mapped_generation(mm)  # 0 in a new file
    _PREAMBLE.pack_into(
        mm, 0, MAGIC, SegmentState.WRITING, len(header), geom.num_layers, flags, old
    )
    mm[HEADER_OFFSET : HEADER_OFFSET + len(header)] = header
    struct.pack_into("<Q", mm, GENERATION_OFFSET, generation)


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


def mark_layer(mm: mmap.mmap, geom: SegmentGeometry, layer: int, checksum: int) -> None:
    """Publish one written layer to a reader following the writer (``follow.py``): its
    checksum, then its ready mark (x86 keeps the two stores in order)."""
    struct.pack_into("<Q", mm, geom.table_offset + 8 * layer, checksum)
    struct.pack_into("<I", mm, geom.ready_offset + 4 * layer, 1)


def mark_aborted(mm: mmap.mmap) -> None:
    """Tell a following reader that the writer gave up (before it unlinks the segment)."""
    struct.pack_into("<I", mm, STATE_OFFSET, SegmentState.ABORTED)


def touch(path: Path) -> None:
    """Set the segment's mtime to now, before sealing it: the janitor counts a sealed
    segment's age from there (``janitor.reclaim_orphans``), not from its reservation."""
    with contextlib.suppress(FileNotFoundError):  # gone: its reader will say so
        os.utime(path)


def seal(mm: mmap.mmap, geom: SegmentGeometry, checksums: tuple[int, ...]) -> None:
    """Write the checksum table, then flip the state word: the segment is complete."""
    struct.pack_into(f"<{len(checksums)}Q", mm, geom.table_offset, *checksums)
    struct.pack_into("<I", mm, STATE_OFFSET, SegmentState.SEALED)


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


# -- following a writer (``follow.py``) ----------------------------------------------------
def mapped_state(mm: mmap.mmap) -> SegmentState | None:
    """The state word; None while the writer has not written the preamble yet."""
    return parse_state(mm[: STATE_OFFSET + 4])


def mapped_generation(mm: mmap.mmap) -> int:
    """The generation word (a reused slot's current hand-off; 0 for a one-off segment)."""
    return int(struct.unpack_from("<Q", mm, GENERATION_OFFSET)[0])


def set_state(mm: mmap.mmap, state: SegmentState) -> None:
    struct.pack_into("<I", mm, STATE_OFFSET, state)


def mapped_header(mm: mmap.mmap, name: str) -> tuple[KVLayout, int, SegmentGeometry]:
    """Layout, token count and geometry from a mapping whose preamble is written."""
    magic, _, header_len, num_layers, _, _ = _PREAMBLE.unpack_from(mm, 0)
    if magic != MAGIC:
        raise KVTransferError(f"shm segment {name!r} is not a pdserve KV segment")
    layout, num_tokens = parse_header(bytes(mm[HEADER_OFFSET : HEADER_OFFSET + header_len]))
    if num_layers != layout.num_layers:
        raise KVTransferError(
            f"shm segment {name!r}: {num_layers} layers, its header says {layout.num_layers}"
        )
    geom = SegmentGeometry.of(header_len, layout, num_tokens)
    if len(mm) < geom.total:
        raise KVTransferError(f"shm segment {name!r} is truncated")
    return layout, num_tokens, geom


def mapped_layer(mm: mmap.mmap, geom: SegmentGeometry, layer: int) -> int | None:
    """Layer ``layer``'s checksum once its writer marked it written, else None."""
    (ready,) = struct.unpack_from("<I", mm, geom.ready_offset + 4 * layer)
    if ready != 1:
        return None
    (checksum,) = struct.unpack_from("<Q", mm, geom.table_offset + 8 * layer)
    return int(checksum)


# -- reading ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """What a sealed segment says about itself."""

    layout: KVLayout
    num_tokens: int
    geom: SegmentGeometry
    checksums: tuple[int, ...]


def read_header(fd: int, offset: int, name: str, capability: bytes = b"") -> SegmentHeader:
    """Preamble, header and checksum table of the sealed segment at ``offset`` of ``fd``;
    ``CapabilityError`` (before anything else is read) if ``capability`` is not its own."""
    if os.fstat(fd).st_size < offset + HEADER_OFFSET:  # created, not reserved yet
        raise KVTransferError(f"shm segment {name!r} is not sealed (its writer has not begun)")
    raw = _pread_exact(fd, HEADER_OFFSET, offset)
    magic, state, header_len, num_layers, flags, _ = _PREAMBLE.unpack_from(raw)
    if magic == bytes(len(MAGIC)):  # created and reserved, its preamble not written yet
        raise KVTransferError(f"shm segment {name!r} is not sealed (its writer has not begun)")
    if magic != MAGIC:
        raise KVTransferError(f"shm segment {name!r} is not a pdserve KV segment")
    check_capability(raw[CAPABILITY_OFFSET:HEADER_OFFSET], capability, name)
    if flags & FLAG_POOLED:  # only a claim (``slots.py``) may read a reused slot
        raise KVTransferError(
            f"shm segment {name!r} is a reused slot; its handle lacks the generation"
        )
    if state != SegmentState.SEALED:
        raise KVTransferError(f"shm segment {name!r} is not sealed (its writer never finished)")
    layout, num_tokens = parse_header(_pread_exact(fd, header_len, offset + HEADER_OFFSET))
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
    fd: int,
    offset: int,
    head: SegmentHeader,
    checksums: tuple[int, ...],
    deadline: float,
    pool: Executor | None = None,
) -> KVPayload:
    """Every layer, as views over a private mapping of the segment, each checked against its
    checksum (``check_layers``).

    No copy: the payload's K and V ``[num_tokens, kvh, hd]`` are views over the mapping, which
    they keep alive; the engine's import is the only copy into its blocks. The mapping is
    ``MAP_PRIVATE`` (writable views, and a stray write stays in this process). Unlink the
    segment before calling this: then no one can open it anew, and its writer closed its own
    mapping when it sealed, so the bytes checked are the bytes imported.
    """
    # mmap's offset must be page-aligned: map from 0 and index from ``offset``.
    mm = mmap.mmap(
        fd, offset + head.geom.total, flags=mmap.MAP_PRIVATE,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )  # fmt: skip
    check_layers(mm, offset, head.geom, checksums, deadline, pool)
    return payload_views(mm, offset, head.layout, head.num_tokens, head.geom)


def check_layers(
    mm: mmap.mmap,
    offset: int,
    geom: SegmentGeometry,
    checksums: tuple[int, ...],
    deadline: float,
    pool: Executor | None = None,
    *,
    populate: bool = True,
) -> None:
    """Check every layer of the segment at ``offset`` of ``mm`` against its checksum
    (``deadline``, ``time.monotonic``, checked between layers); ``populate``: fill in each
    range's page tables just before hashing it (a fresh mapping; ``Populator``).

    With a ``pool``, one of its threads hashes every layer's K while this thread hashes the
    V's; the first layer that fails its checksum is reported once both are done.
    """
    if len(checksums) != geom.num_layers:
        raise KVTransferError(f"{len(checksums)} layer checksums for {geom.num_layers} layers")
    half = geom.layer_bytes // 2
    fill = Populator(mm) if populate else None
    with memoryview(mm) as whole:

        def digests(start: int) -> Callable[[], list[int]]:
            # The XXH3-64 of each layer's K (start 0) or V (start half), in layer order.
            def run() -> list[int]:
                out = []
                for i in range(geom.num_layers):
                    if time.monotonic() > deadline:
                        raise KVTransferError(
                            f"shm read timed out at layer {i} of {geom.num_layers}"
                        )
                    at = offset + geom.layer_offset(i) + start
                    if fill is not None:
                        fill(at, half)
                    with whole[at : at + half] as part:
                        out.append(layer_checksum(part))
                return out

            return run

        ks, vs = in_pair(pool, digests(0), digests(half))
    for i, (kd, vd) in enumerate(zip(ks, vs, strict=True)):
        if combine(kd, vd) != checksums[i]:
            raise KVTransferError(f"KV layer {i} failed its checksum")


def payload_views(
    mm: mmap.mmap,
    offset: int,
    layout: KVLayout,
    num_tokens: int,
    geom: SegmentGeometry,
    release: Callable[[], None] | None = None,
) -> KVPayload:
    """The payload as K and V ``[num_tokens, kvh, hd]`` views over a mapping of the segment
    at ``offset``, which they keep alive. ``release`` (a reused slot's claim) runs once the
    engine imported the payload (``KVPayload.release``) or, failing that, once every view is
    gone."""
    size, half = geom.layer_bytes, geom.layer_bytes // 2
    span = geom.num_layers * size
    base = np.frombuffer(mm, dtype=np.uint8, count=span, offset=offset + geom.data_offset)
    done = None if release is None else weakref.finalize(base, release)
    # Every view below keeps ``base`` (and so the finalizer's trigger) alive.
    dtype, shape = DTYPES[layout.dtype], (num_tokens, layout.num_kv_heads, layout.head_dim)
    layers = [base[i * size : (i + 1) * size] for i in range(geom.num_layers)]
    del base
    return KVPayload(
        layout,
        num_tokens,
        tuple(t[:half].view(dtype).reshape(shape) for t in layers),
        tuple(t[half:].view(dtype).reshape(shape) for t in layers),
        release=done,
    )


def mapped_sealed_header(mm: mmap.mmap, name: str) -> SegmentHeader:
    """What a sealed segment's mapping says about itself (a claimed slot's, ``slots.py``)."""
    layout, num_tokens, geom = mapped_header(mm, name)
    table = struct.unpack_from(f"<{geom.num_layers}Q", mm, geom.table_offset)
    return SegmentHeader(layout, num_tokens, geom, tuple(int(c) for c in table))


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise KVTransferError(f"shm segment ends at {offset + len(data)}; needed {offset + n}")
    return data
