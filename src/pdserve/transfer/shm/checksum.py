"""The checksum of one layer's bytes in a hand-off: XXH3-64 of K and of V, combined.

XXH3 runs at memory speed (10+ GB/s on one core with AVX2/AVX-512), where ``zlib.crc32``
manages 0.5 to 2 GB/s; with CRC-32 on both sides the checksums, not the copies, bounded the
shm transport. It detects accidental corruption (a flipped byte, a torn write) as well as a
CRC does for this purpose; neither is a defence against a deliberate forger.

A layer's checksum is ``kv_checksum``: XXH3-64 over the 16 bytes of the two digests (K's,
then V's, little-endian u64). Hashing K and V separately lets the receiver's two threads
take one each (verify); one thread alone gets the same value. The sender copies and hashes
whole layers, alternating between two threads (``writer.SegmentWriter``).

A contiguous CPU source is copied by ``_hashcopy`` (a C module built at install; optional;
its AVX2 build, ``_hashcopy_avx2``, where the CPU has AVX2: 5-12% faster writer here):
each small piece is hashed from the source, which brings it into cache, then copied from there
with streaming stores, which do not read the destination first. That is two passes over
memory, as a large memcpy makes, where copying into the mapping and then hashing what was
written makes three (the store reads each destination line, the hash reads it again). The
checksum is the same either way: XXH3-64 of the bytes; the receiver hashes what it finds.

Other CPU copies are numpy's, not ``Tensor.copy_``: a numpy copy runs on the calling thread
and releases the GIL, where ``copy_`` would start an OpenMP team in each of the two threads.
"""

from __future__ import annotations

import importlib
import struct
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import xxhash

from pdserve.cpuinfo import cpu_flags
from pdserve.engine.kv_arrays import host_view

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

Buffer = bytes | bytearray | memoryview

HashCopy = Callable[[np.ndarray, np.ndarray, int], int]
Hash = Callable[[Buffer], int]


def _load_native() -> tuple[HashCopy | None, Hash | None, str]:
    """The one-pass copy and the GIL-free hash: the AVX2 build on a CPU that has AVX2
    (XXH3's AVX2 loop hashes faster), else the baseline build; (None, None, "") when neither
    was built (no C compiler: numpy's copy and the ``xxhash`` package, the same checksums)."""
    names = (["_hashcopy_avx2"] if "avx2" in cpu_flags() else []) + ["_hashcopy"]
    for name in names:
        try:
            module = importlib.import_module(f"pdserve.transfer.{name}")
        except ImportError:
            continue
        return module.hash_copy, module.hash64, name
    return None, None, ""


_hash_copy, _hash64, NATIVE_MODULE = _load_native()
NATIVE = _hash_copy is not None
"""Whether the one-pass copy (``_hashcopy``) was built."""
_NATIVE_PIECE_BYTES = 64 * 1024
"""Hashed, then streamed out, at a time: the piece is still in L1/L2 for the copy."""

_R = TypeVar("_R")
_DIGESTS = struct.Struct("<QQ")
# Copied as the unsigned int of its item size: no dtype conversion, bfloat16 words included.
_INT_BY_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def layer_checksum(data: Buffer) -> int:
    """XXH3-64 of ``data`` (an unsigned 64-bit int); reads the buffer in place, no copy.

    The native build's hash releases the GIL, so the reader's two threads hash K and V at
    once; the ``xxhash`` package's holds it, and they hash in turn."""
    if _hash64 is not None:
        return _hash64(data)
    return int(xxhash.xxh3_64_intdigest(data))


def combine(k_digest: int, v_digest: int) -> int:
    """A layer's checksum from the XXH3-64 of its K and of its V bytes."""
    return int(xxhash.xxh3_64_intdigest(_DIGESTS.pack(k_digest, v_digest)))


def kv_checksum(k: Buffer, v: Buffer) -> int:
    """A layer's checksum from its K and V bytes, on this thread (the reference)."""
    return combine(layer_checksum(k), layer_checksum(v))


def in_pair(
    pool: Executor | None, first: Callable[[], _R], second: Callable[[], _R]
) -> tuple[_R, _R]:
    """``(first(), second())``: ``first`` on ``pool`` while this thread runs ``second``.

    Without a pool, both on this thread. Returns only once both have ended, whatever
    happened (neither outlives the call); if both raise, ``second``'s error is raised with
    ``first``'s attached as a note."""
    if pool is None:
        return first(), second()
    future = pool.submit(first)
    try:
        b = second()
    except BaseException as err:
        other = future.exception()  # waits: nothing may still run on the caller's buffers
        if other is not None:
            err.add_note(f"the other half failed too: {other!r}")
        raise
    return future.result(), b


def copy_and_hash(
    dst: np.ndarray, src: KVArray, piece_bytes: int, *, torch_copy: bool = False
) -> int:
    """Copy ``src`` (``[T, ...]``, any strides; a numpy array or a tensor on any device)
    into the contiguous uint8 ``dst`` (exactly its size) and return the XXH3-64 of what was
    written.

    A contiguous host ``src`` goes through ``_hashcopy`` on this thread when it was built.
    Otherwise the copy goes ``piece_bytes`` (rounded to whole leading rows) at a time and each
    piece is hashed right after it is written, while it is still in cache; a host ``src`` is
    copied by numpy on this thread, unless it is a tensor and ``torch_copy`` (then by
    ``Tensor.copy_``, on torch's intra-op threads: faster when this is the only thread
    copying). A device tensor is copied by torch, straight into ``dst``.
    """
    view = None if torch_copy and not isinstance(src, np.ndarray) else host_view(src)
    if view is not None and _hash_copy is not None and view.flags.c_contiguous:
        return _hash_copy(dst, view.reshape(-1).view(np.uint8), _NATIVE_PIECE_BYTES)
    rows = src.shape[0]
    row_bytes = dst.size // max(1, rows)
    step = max(1, piece_bytes // max(1, row_bytes))
    hasher = xxhash.xxh3_64()
    written = dst.data  # a memoryview: what the hasher reads
    if view is not None:
        # Same-size int views of both sides ([T, ...], src strided as it comes): no dtype
        # conversion, one strided memcpy loop per piece, GIL released.
        s = view.view(_INT_BY_SIZE[view.itemsize])
        d = dst.view(s.dtype).reshape(s.shape)
        for start in range(0, rows, step):
            np.copyto(d[start : start + step], s[start : start + step])
            hasher.update(written[start * row_bytes : (start + step) * row_bytes])
    else:
        # Device-to-host (or the intra-op threads): torch's copy, straight into the destination.
        from pdserve.engine.kv_tensors import copy_into  # a tensor: torch is loaded

        assert not isinstance(src, np.ndarray)  # an array always has a host view
        out = copy_into(dst, src)
        for start in range(0, rows, step):
            out[start : start + step].copy_(src[start : start + step])
            hasher.update(written[start * row_bytes : (start + step) * row_bytes])
    return int(hasher.intdigest())
