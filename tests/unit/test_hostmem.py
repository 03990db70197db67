"""Host memory figures and each worker's share of a KV budget."""

from __future__ import annotations

import os
from typing import Any

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
