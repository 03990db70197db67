"""A prefill worker killed while every prefill queue is at its limit: the requests it held are
placed again on the survivor as soon as it has room, and none is refused. Real processes on
the sim backend (a modelled H100, slowed down so that prefills take seconds), the scheduler's
queue limit small (``--prefill-queue-batches``: four of these prompts per worker), clients
that retry nothing."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import Cluster
from tests.integration.failover_load import (
    NO_RETRY,
    Job,
    Load,
    kill,
    scheduler_view,
    until,
)
from tests.integration.metrics_probe import metric
from tests.integration.test_scheduler_outage import nothing_reserved

pytestmark = pytest.mark.integration

PROMPT_TOKENS = 1000
PER_WORKER = 4
"""Prompts a prefill worker's queue takes: ``--prefill-queue-batches 2`` of its 2048-token
batches hold four of them, not five."""
MAX_TOKENS = 4
WORKER_ARGS = (
    "--sim-profile", "roofline:h100:llama-3-8b", "--sim-time-scale", "40",
    "--heartbeat-interval-s", "0.5",
)  # fmt: skip
SCHEDULER_ARGS = ("--policy", "least_loaded", "--prefill-queue-batches", "2")


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=240))


def requests(n: int) -> list[Job]:
    rng = random.Random(31)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        Job(f"full-{i}", [rng.randrange(4, 2048) for _ in range(PROMPT_TOKENS)], params)
        for i in range(n)
    ]


def test_requests_of_a_dead_prefill_worker_wait_for_room(tiny_llama_dir: Path) -> None:
    batch = requests(2 * PER_WORKER)  # both queues full
    with Cluster(
        tiny_llama_dir, backend="sim", num_prefill=2, num_decode=1,
        worker_args=WORKER_ARGS, scheduler_args=SCHEDULER_ARGS, log_level="WARNING",
    ) as c:  # fmt: skip
        scheduler_metrics = c.metrics_urls()["scheduler"]
        router_metrics = c.metrics_urls()["router"]

        def decisions(outcome: str) -> float:
            return metric(scheduler_metrics, "pdserve_scheduler_decisions_total", outcome=outcome)

        async def body() -> None:
            for worker in await scheduler_view(c.scheduler_address):
                assert 2 * worker.max_batch_tokens // PROMPT_TOKENS == PER_WORKER, worker

            load = Load(c.router_address, retry=NO_RETRY)
            tasks = load.start(batch)
            await until(lambda: decisions("assigned") >= len(batch), "every request placed")
            assert not any(t.done() for t in tasks) and decisions("no_capacity") == 0
            kill(c.workers("prefill")[0])  # mid-prefill of its four requests
            outcomes = list(await asyncio.gather(*tasks))
            for job, got in zip(batch, outcomes, strict=True):
                assert got.finish == "length" and len(got.tokens) == MAX_TOKENS, job.rid
                assert got.completion_tokens == MAX_TOKENS, job.rid
            # The survivor was full when they came: they waited for room, and none failed.
            assert decisions("no_capacity") > 0
            waits = "pdserve_router_scheduler_wait_seconds_count"
            assert metric(router_metrics, waits, cause="full") > 0
            await nothing_reserved(c, c.scheduler_address)
            await load.client.close()

        run(body)
