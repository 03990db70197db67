"""Keep the C allocator from returning every large buffer to the kernel at once.

A KV stream moves MiB-sized messages: gRPC and the chunk codec allocate one buffer per
message and free it a moment later. glibc serves allocations above ``M_MMAP_THRESHOLD``
(128 KiB at start, raised dynamically up to 32 MiB) with a fresh ``mmap`` and trims free heap
above ``M_TRIM_THRESHOLD``, so a stream of 1 MiB messages kept mapping, faulting in (256 page
faults per MiB) and unmapping memory: measured here, a Put stream of 1 MiB chunks ran at
0.66 GB/s that way and at 1.78 GB/s with the thresholds below (loopback TCP: 3 to 4 GB/s).

``tune_for_streams`` raises both thresholds once, at the start of a process that moves KV
(KV store, prefill and decode workers, the transfer benchmark). The price is that up to
``trim_bytes`` (2 GiB) of freed heap stays with the process for reuse. Why so much: memory a
process gives back is memory it must fault in again next time, and on a virtual machine whose
balloon reports free pages to the host (this one's does) a page faulted in anew costs ~9 us
per 4 KiB, not ~1 us: measured here, touching 18 GB for the first time ran at 0.43 GB/s, the
same 4 GB again at 5 GB/s, and a process's first 200 MB Put at 0.4 GB/s against 1.7-2 GB/s for
the next ones. A 32K-token hand-off of the base preset is 1.6 GB; with 1 GiB kept, part of it
was faulted in anew every time. ``mmap_bytes`` (256 MiB) covers the largest single buffer of
such a hand-off (a 64 MiB layer frame at 32K tokens), which above 64 MiB was a fresh ``mmap``
for every layer of every hand-off. Elsewhere than glibc it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameters (glibc's ``malloc.h``)."""

DEFAULT_MMAP_BYTES = 256 * 1024 * 1024
DEFAULT_TRIM_BYTES = 2 * 1024 * 1024 * 1024


def tune_for_streams() -> bool:
    """Serve allocations up to ``DEFAULT_MMAP_BYTES`` from the heap and keep up to
    ``DEFAULT_TRIM_BYTES`` of free heap; True if the C library took both settings."""
    mmap_bytes, trim_bytes = DEFAULT_MMAP_BYTES, DEFAULT_TRIM_BYTES
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        logger.info("no mallopt in this C library: allocator thresholds left as they are")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, trim_bytes))
    if not ok:
        logger.warning("mallopt refused the stream thresholds (%d, %d)", mmap_bytes, trim_bytes)
    return ok
