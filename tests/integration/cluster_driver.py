"""Run a cluster, stream requests through it, scrape its metrics: in a process of its own.

``python tests/integration/cluster_driver.py CONFIG.json`` starts a ``Cluster`` as the config
says (model, worker flags, environment, OTLP endpoint, trace file), streams the configured
requests concurrently, scrapes every service's ``/metrics``, stops the cluster (every service
flushes its spans on the way out) and writes what it saw to ``config["out"]`` as JSON.

The tracing tests run this instead of starting the cluster themselves: the launcher forks its
services, and a fork from a process in which gRPC threads run (an OTLP receiver, or any gRPC
server an earlier test ran in the same pytest process) can abort the child before it execs.
This process starts with no gRPC thread, and the test process starts it without a fork hook
(vfork), so neither is exposed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import AsyncClient
from pdserve.launcher import Cluster, read_heartbeats


def _scrape(url: str) -> list[list[Any]]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return [
        [s.name, dict(s.labels), s.value]
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


async def _stream_all(address: str, requests: list[dict[str, Any]]) -> dict[str, list[int]]:
    async def one(client: AsyncClient, req: dict[str, Any]) -> tuple[str, list[int]]:
        tokens: list[int] = []
        async with client.stream(
            req["prompt"], max_tokens=req["max_tokens"], temperature=0, ignore_eos=True,
            request_id=req["request_id"], tenant=req.get("tenant"),
        ) as stream:  # fmt: skip
            async for delta in stream:
                tokens.extend(delta.token_ids)
        return req["request_id"], tokens

    async with AsyncClient(address, timeout=120) as client:
        return dict(await asyncio.gather(*(one(client, r) for r in requests)))


def drive(config: dict[str, Any]) -> dict[str, Any]:
    """Run ``config`` (see the module docstring) and return what it saw."""
    trace_file = config.get("trace_file")
    cluster = Cluster(
        Path(config["model"]),
        worker_args=config["worker_args"],
        env=config.get("env", {}),
        otlp_endpoint=config.get("otlp_endpoint"),
        trace_file=Path(trace_file) if trace_file else None,
    )
    with cluster:
        tokens = asyncio.run(_stream_all(cluster.router_address, config["requests"]))
        metrics = {name: _scrape(url) for name, url in cluster.metrics_urls().items()}
        workers = {
            w.role.value: w.id for w in read_heartbeats(cluster.redis_url or "", cluster.namespace)
        }
    return {"tokens": tokens, "metrics": metrics, "worker_ids": workers}


def run_driver(config: dict[str, Any], config_path: Path, timeout_s: float = 600.0) -> Any:
    """Run this script on ``config`` in a fresh process; what it saw, or AssertionError with
    the tail of its output."""
    config_path.write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, str(Path(__file__)), str(config_path)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise AssertionError(f"cluster driver failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(Path(config["out"]).read_text())


def main(argv: list[str]) -> int:
    config = json.loads(Path(argv[0]).read_text())
    Path(config["out"]).write_text(json.dumps(drive(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
