"""Host memory figures and each worker's share of a KV budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from pdserve import hostmem
from pdserve.hostmem import MIB, MIN_KV_BYTES, kv_share


def test_a_share_is_split_capped_and_floored() -> None:
    gib = 1024 * MIB
    assert kv_share(16 * gib, 4, 0.5, 512 * MIB) == 512 * MIB  # plenty: the engine's default
    assert kv_share(2 * gib, 4, 0.5, 512 * MIB) == 256 * MIB  # 1 GiB over four workers
    assert kv_share(64 * MIB, 8, 0.5, 512 * MIB) == MIN_KV_BYTES  # never below a usable pool


def test_this_process_and_this_host_are_read() -> None:
    rss = hostmem.rss_bytes(os.getpid())
    available = hostmem.available_bytes()
    assert rss is not None and rss > 10 * MIB
    assert available is not None and available > rss
    assert hostmem.rss_bytes(2**22 + 12345) is None  # no such process


def test_a_cluster_sizes_its_workers_pools_from_the_host(monkeypatch: Any, tmp_path: Any) -> None:
    from pdserve.launcher import Cluster

    monkeypatch.setattr(hostmem, "available_bytes", lambda: 1024 * MIB)
    two = Cluster(tmp_path, num_prefill=1, num_decode=1)
    assert two.kv_budget() == 256 * MIB  # half over two
    sized = Cluster(tmp_path, worker_args=["--kv-blocks=64"])
    assert sized.kv_budget() is None  # the caller sized the pools
    assert Cluster(tmp_path, worker_args=["--kv-cache-bytes", "9"]).kv_budget() is None
    assert Cluster(tmp_path, backend="sim").kv_budget() is None  # its own memory model


_TRIM_PROBE = """
import ctypes, json, os
from pdserve import hostmem

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(1000) for _ in range(60_000)]  # about 60 MB of small chunks
for p in blocks[:-1]:  # the last one stays: the freed pages sit below it, not at the top
    libc.free(p)
held = hostmem.rss_bytes(os.getpid())
trimmed = hostmem.trim_heap()
print(json.dumps([held, hostmem.rss_bytes(os.getpid()), trimmed]))
"""


def test_trim_heap_hands_freed_pages_back() -> None:
    """glibc keeps 60 MB of freed small chunks that sit below a live one; ``trim_heap`` hands
    them back. In a child: the trim is process-wide."""
    if hostmem._malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim")
    out = subprocess.run(
        [sys.executable, "-c", _TRIM_PROBE], capture_output=True, text=True, check=True
    )
    held, after, trimmed = json.loads(out.stdout)
    assert trimmed is True
    assert held - after > 40 * MIB
