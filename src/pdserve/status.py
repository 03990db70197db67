"""``pdserve status``: the live workers of a cluster, read from their Redis heartbeats."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Sequence

from redis.exceptions import RedisError

from pdserve.errors import WorkerUnavailableError
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.redis_url import redacted
from pdserve.scheduling.registry import RedisWorkerRegistry, connect
from pdserve.scheduling.worker_info import WorkerInfo
from pdserve.up_state import running, runtime_dir

_ROW = "{:<28} {:<8} {:<22} {:>4} {:>7} {:>12} {:>7} {:>15}  {}"


async def fetch_workers(redis_url: str, namespace: str = "pdserve") -> list[WorkerInfo]:
    """Every worker whose heartbeat is alive, sorted by id."""
    redis = connect(redis_url)
    try:
        return await RedisWorkerRegistry(redis, keys=KeySpace(namespace)).list_workers()
    finally:
        await redis.aclose()


def format_workers(workers: Sequence[WorkerInfo], now: float) -> list[str]:
    """A table: id, role, address, load (running sequences, queued tokens), free KV blocks,
    heartbeat age, KV link bandwidth (``kv_rate``), the phases it serves now (and a planner's
    duty, draining)."""
    lines = [
        _ROW.format(
            "ID", "ROLE", "ADDRESS", "RUN", "QUEUED", "FREE BLOCKS", "AGE", "KV MB/s AVG/PEAK",
            "SERVES",
        )
    ]  # fmt: skip
    for w in workers:
        serves = ",".join(w.phases) or "-"
        if w.duty:
            serves += f" (duty {w.duty}{', switching' if w.switching else ''})"
        row = _ROW.format(
            w.id, w.role.value, w.address, w.running_seqs, w.queued_tokens,
            f"{w.kv_blocks_free}/{w.kv_blocks_total}", f"{now - w.ts:.1f}s", kv_rate(w), serves,
        )  # fmt: skip
        lines.append(row + (" draining" if w.draining else ""))
    return lines


def kv_rate(worker: WorkerInfo) -> str:
    """``AVG/PEAK`` in MB/s: the KV bytes its hand-offs moved over the last 10 s, all links
    together, and the busiest 100 ms of them; ``-`` for a heartbeat without them."""
    avg, peak = worker.kv_bytes_per_s, worker.kv_peak_bytes_per_s
    if avg is None or peak is None:
        return "-"
    return f"{avg / 1e6:.1f}/{peak / 1e6:.1f}"


def main_status(argv: Sequence[str]) -> int:
    """Entry of ``pdserve status``; exit status 1 when no worker is alive.

    Without ``--redis-url`` (or ``$REDIS_URL``) it reads every ``pdserve up`` running for this
    user (``up_state``), each under a heading."""
    p = argparse.ArgumentParser(prog="pdserve status", description="list live workers")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="the cluster's Redis (default: $REDIS_URL, else every running "
                   "'pdserve up' of this user)")  # fmt: skip
    p.add_argument("--namespace", default=None, help="key namespace (default: pdserve)")
    args = p.parse_args(list(argv))
    if args.redis_url is not None:
        return _show(args.redis_url, args.namespace or "pdserve")
    directory = runtime_dir()
    ups = running(directory)
    if not ups:
        print(
            f"no running 'pdserve up' found (looked in {directory}); point at a cluster with "
            "--redis-url URL or $REDIS_URL"
        )
        return 1
    worst = 0
    for i, up in enumerate(ups):
        print(f"{'' if i == 0 else chr(10)}pdserve up (pid {up.pid}): router at {up.router}")
        worst = max(worst, _show(up.redis_url, args.namespace or up.namespace))
    return worst


def _show(redis_url: str, namespace: str) -> int:
    try:
        workers = asyncio.run(fetch_workers(redis_url, namespace))
    except (OSError, RedisError) as e:
        raise WorkerUnavailableError(f"cannot read {redacted(redis_url)}: {e}") from e
    if not workers:
        print(f"no live workers in {redacted(redis_url)} (namespace {namespace})")
        return 1
    print("\n".join(format_workers(workers, time.time())))
    return 0
