"""Waiting for a cluster's child processes to be ready: their port files, health checks and
heartbeats. Child processes offer nothing to block on, so readiness is polled."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

from pdserve.errors import WorkerUnavailableError
from pdserve.scheduling.keys import KeySpace, text
from pdserve.scheduling.redis_url import sync_client
from pdserve.scheduling.worker_info import WorkerInfo
from pdserve.service_process import ServiceProcess

POLL_S = 0.05
"""Interval of the polls."""


def read_heartbeats(redis_url: str, namespace: str = "pdserve") -> list[WorkerInfo]:
    """Live worker heartbeats, read with a plain synchronous Redis client."""
    keys = KeySpace(namespace)
    client = sync_client(redis_url)
    try:
        ids = [text(i) for i in cast(list[bytes], client.zrange(keys.worker_index, 0, -1))]
        raws = client.mget([keys.worker(i) for i in ids]) if ids else []
    finally:
        client.close()
    return [WorkerInfo.from_json(raw) for raw in raws if raw is not None]


def beating(redis_url: str, namespace: str) -> Callable[[ServiceProcess], bool]:
    """Whether a worker's heartbeat (its role, on its port) is in Redis."""

    def ready(s: ServiceProcess) -> bool:
        port = f":{s.port}"
        return any(
            w.role.value == s.role and w.address.endswith(port)
            for w in read_heartbeats(redis_url, namespace)
        )

    return ready


def wait_for(
    what: str,
    services: Sequence[ServiceProcess],
    ready: Callable[[ServiceProcess], bool],
    deadline: float,
    log_dir: Path | None,
) -> None:
    """Poll until every service is ``ready``; ``WorkerUnavailableError`` (with the log tails
    of those still pending) once ``deadline`` (``time.monotonic``) passes or one exits."""
    pending = list(services)
    while pending:
        for s in pending:
            s.check_alive()
        pending = [s for s in pending if not ready(s)]
        if not pending:
            return
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {s.name}:\n{s.log_tail(10)}" for s in pending)
            raise WorkerUnavailableError(
                f"timed out waiting for {what} of {', '.join(s.name for s in pending)}; "
                f"logs in {log_dir}\n{tails}"
            )
        time.sleep(POLL_S)
