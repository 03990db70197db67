"""Sim worker processes, started as ``pdserve up --backend sim`` starts them, hold no torch.

A prefill and a decode sim worker (with the real Redis, KV store, scheduler and router)
serve requests whose KV is handed over through the real transports; then every worker's
memory map must show no torch library, and each worker's resident memory is reported.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.client import AsyncClient
from pdserve.launcher import Cluster
from pdserve.models.demo import init_checkpoint

pytestmark = pytest.mark.integration


def torch_mappings(pid: int) -> list[str]:
    """The files of ``pid``'s memory map that belong to torch (its shared libraries)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    files = {line.split()[-1] for line in lines if len(line.split()) >= 6}
    return sorted(f for f in files if "libtorch" in f or "/torch/" in f)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def serve(address: str, n: int) -> list[int]:
    async with AsyncClient(address, timeout=120) as client:
        results = await asyncio.gather(
            *(
                client.generate([16 + (i * 7 + j) % 500 for j in range(90)], max_tokens=8)
                for i in range(n)
            )
        )
    return [len(r.token_ids) for r in results]


def test_sim_workers_run_without_torch(tmp_path: Path) -> None:
    model = init_checkpoint(tmp_path / "model", "tiny", dtype="float32")
    with Cluster(
        model, backend="sim", mode="disaggregated", num_prefill=1, num_decode=1,
        worker_args=("--sim-profile", "roofline:h100:llama-3-8b"), log_level="WARNING",
    ) as cluster:  # fmt: skip
        assert asyncio.run(serve(cluster.router_address, 6)) == [8] * 6
        workers = {s.name: s.proc.pid for s in cluster.workers() if s.proc is not None}
        assert len(workers) == 2
        for name, pid in workers.items():
            assert torch_mappings(pid) == [], name
            print(f"{name}: RSS {rss_mb(pid):.0f} MB, no torch mapped")
