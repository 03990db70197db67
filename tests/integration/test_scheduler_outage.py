"""A scheduler killed under load costs no request: with one scheduler, the requests that
arrive while it is down wait in the router until it is back (``--scheduler-wait-s``), and stay
cancellable meanwhile; with two replicas, the other one places them at once. Real processes,
clients that retry nothing (``NO_RETRY``): whatever rides out the kill is the router's doing.
Every stream must equal the engine's own output, and no reservation may be left afterwards
(the default reservation TTL: a lost release would show)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from pdserve.engine.engine import Engine
from pdserve.launcher import Cluster
from pdserve.scheduling.keys import KeySpace
from pdserve_bench.faults.leaks import live_reservations
from tests.integration.failover_load import (
    INTERVAL_S,
    NO_RETRY,
    Load,
    check,
    jobs,
    kill,
    references,
    scheduler_view,
    until,
)
from tests.integration.metrics_probe import metric

pytestmark = pytest.mark.integration

WORKER_ARGS = (
    "--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
    "--heartbeat-interval-s", str(INTERVAL_S),
)  # fmt: skip
ROUTER_ARGS = ("--scheduler-wait-s", "60")
"""Longer than the default 10 s: the test starts the scheduler again only once every request
waits, and a process start on a busy test machine takes its time."""
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=256)


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=240))


def router_metric(c: Cluster, name: str, **labels: str) -> float:
    return metric(c.metrics_urls()["router"], name, **labels)


async def nothing_reserved(c: Cluster, scheduler_address: str) -> None:
    """The scheduler's view shows no capacity reserved on any worker, and Redis holds no
    live reservation."""
    assert c.redis_url is not None
    redis_url = c.redis_url

    async def clean() -> bool:
        workers = await scheduler_view(scheduler_address)
        if any(w.reserved_tokens or w.reserved_blocks for w in workers):
            return False
        return await live_reservations(redis_url, KeySpace(c.namespace)) == 0

    await until(clean, "no reservation left")


def test_requests_wait_out_a_scheduler_restart(tiny_llama_dir: Path, engine: Engine) -> None:
    batch = jobs(21, 12, max_tokens=MAX_TOKENS)
    expected = references(engine, batch)
    (gives_up,) = jobs(22, 1, prefix="quit", max_tokens=MAX_TOKENS)
    with Cluster(
        tiny_llama_dir, worker_args=WORKER_ARGS, router_args=ROUTER_ARGS, log_level="WARNING"
    ) as c:
        scheduler = next(s for s in c.services if s.name == "scheduler")

        def waiting() -> float:
            return router_metric(c, "pdserve_router_scheduler_waiting")

        async def body() -> None:
            load = Load(c.router_address, retry=NO_RETRY)
            kill(scheduler)
            tasks = load.start(batch)
            quitter = asyncio.create_task(load.one(load.client, gives_up))
            everyone = [*tasks, quitter]
            await until(
                lambda: waiting() == len(everyone) or any(t.done() for t in everyone),
                "every request waiting for the scheduler",
            )
            for task in everyone:
                if task.done():
                    task.result()  # raises what the request failed with
            # A caller may give up while its request waits.
            quitter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await quitter
            await until(lambda: waiting() == len(batch), "the cancelled request to stop waiting")
            await until(
                lambda: router_metric(c, "pdserve_requests_total", outcome="cancelled") == 1,
                "the router to count it cancelled",
            )

            assert scheduler.port is not None
            scheduler.spawn(c.child_env(), port=scheduler.port)  # back on its address
            check(list(await asyncio.gather(*tasks)), batch, expected)
            assert waiting() == 0
            waits = "pdserve_router_scheduler_wait_seconds_count"
            assert router_metric(c, waits, cause="unavailable") == len(everyone)
            await nothing_reserved(c, c.scheduler_address)
            await load.client.close()

        run(body)


def test_a_dead_scheduler_replica_costs_no_request(tiny_llama_dir: Path, engine: Engine) -> None:
    first, second = jobs(23, 8, max_tokens=MAX_TOKENS * 2), jobs(24, 16, max_tokens=MAX_TOKENS)
    expected = references(engine, first + second)
    with Cluster(
        tiny_llama_dir, worker_args=WORKER_ARGS, num_schedulers=2, log_level="WARNING"
    ) as c:
        victim = next(s for s in c.services if s.name == "scheduler-1")

        async def body() -> None:
            load = Load(c.router_address, retry=NO_RETRY)
            tasks = load.start(first)
            await until(lambda: load.all_past(first, 1), "the first requests placed")
            kill(victim)  # their renewals and releases go to the other replica from now on
            tasks += load.start(second)  # half of them would ask the dead replica first
            check(list(await asyncio.gather(*tasks)), first + second, expected)
            assert router_metric(c, "pdserve_requests_total", outcome="ok") == len(tasks)
            await nothing_reserved(c, c.scheduler_address)
            await load.client.close()

        run(body)
