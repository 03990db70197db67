"""This host's memory: what is available, what a process holds, and each worker's share of
a KV budget (Linux ``/proc``; elsewhere the figures are unknown and callers keep defaults),
and handing a process's freed heap back to the system."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

MIB = 1 << 20
MIN_KV_BYTES = 16 * MIB
"""A KV pool smaller than this holds too few blocks to be worth starting."""


def _meminfo_kib(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes() -> int | None:
    """``MemAvailable``: what new allocations can take without swapping."""
    kib = _meminfo_kib("/proc/meminfo", "MemAvailable:")
    return None if kib is None else kib * 1024


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid`` (``VmRSS``); None if gone or unknown."""
    kib = _meminfo_kib(f"/proc/{pid}/status", "VmRSS:")
    return None if kib is None else kib * 1024


def kv_share(available: int, workers: int, fraction: float, ceiling: int) -> int:
    """One worker's KV pool bytes when ``workers`` share ``fraction`` of ``available`` bytes,
    at most ``ceiling`` (the engine's default) and at least ``MIN_KV_BYTES``. On a shared host
    the pools, not the weights, are what grows with the load; vLLM sizes its pool the same way
    from a share of the device (``gpu_memory_utilization``)."""
    share = int(available * fraction) // max(1, workers)
    return max(MIN_KV_BYTES, min(ceiling, share))


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim  # glibc; musl and other systems lack it
    except (AttributeError, OSError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Hand the heap's free memory back to the system (glibc's ``malloc_trim(0)``); True if
    any was. glibc keeps what a burst of work freed (buffers of C extensions, gRPC's among
    them) for reuse, so an idle process would go on holding its peak: a host of many idle
    workers (simulated ones, dozens to a machine) runs short for no work. False where the
    C library has no such call."""
    fn = _malloc_trim()
    return fn is not None and fn(0) == 1
