"""A 16-worker cluster of simulated accelerators on this machine (``--backend sim``): eight
prefill and eight mixed workers modelling H100s serving Llama-3-8B, with the real Redis,
KV store, scheduler and router, under a supervisor.

Every stream is compared token for token with the sim engine run alone (its tokens are a
function of prompt, position and seed): disaggregated (every hand-off through the real
transports, the stand-in KV checked on arrival), colocated, through the SIGKILL of a
decoding worker (the streams migrate), and through a duty switch under load. Nothing may be
left behind: blocks, hand-offs, reservations.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis as sync_redis

from pdserve.client import AsyncClient
from pdserve.engine.engine import Engine
from pdserve.launcher import Cluster, read_heartbeats
from pdserve.models.demo import init_checkpoint
from pdserve.router.rollout import Rollout, write_rollout
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.registry import connect
from pdserve.service_process import ServiceProcess
from pdserve.sim.backend import SimOptions, sim_compute
from pdserve.sim.shapes import MODELS
from tests.integration.failover_load import (
    RESTARTS,
    Job,
    Load,
    Outcome,
    check,
    jobs,
    kill,
    nothing_left,
    references,
    restarted,
    until,
)
from tests.integration.metrics_probe import metric

pytestmark = pytest.mark.integration

PROFILE = "roofline:h100:llama-3-8b"
PREFILL, MIXED = 8, 8
WORKER_ARGS = (
    "--sim-profile", PROFILE, "--heartbeat-interval-s", "0.5",
    "--janitor-interval-s", "0.5", "--kv-lease-s", "5",
)  # fmt: skip
LONG_STREAM = 400
"""Decode steps of about 7 ms each (one H100 reading Llama-3-8B's weights): a stream lasts
about three seconds, long enough for a kill or a duty switch to land mid-way."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served vocabulary and tokenizer (the sim reads no weights)."""
    return init_checkpoint(tmp_path_factory.mktemp("sim_model"), "tiny", dtype="float32")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    """The sim engine alone: the reference every stream must equal."""
    return Engine.from_pretrained(
        model_dir, compute=sim_compute(SimOptions.parse(PROFILE, time_scale=1e-6))
    )


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[Cluster]:
    with Cluster(
        model_dir, backend="sim", mode="conditional", num_prefill=PREFILL, num_decode=MIXED,
        worker_args=WORKER_ARGS, scheduler_args=("--reservation-ttl-s", "5"),
        log_level="WARNING", supervise=True, restart_policy=RESTARTS,
    ) as c:  # fmt: skip
        yield c


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=300))


async def set_split(cluster: Cluster, rollout: Rollout | None) -> None:
    redis = connect(cluster.redis_url or "")
    try:
        await write_rollout(redis, KeySpace(cluster.namespace), rollout)
    finally:
        await redis.aclose()


def arm_requests(cluster: Cluster, arm: str) -> float:
    """Requests the router has served on ``arm`` of a rollout split."""
    return metric(cluster.metrics_urls()["router"], "pdserve_arm_requests_total", arm=arm)


async def follow_split(cluster: Cluster, mode: str) -> None:
    """Wait until the router sends requests to ``mode``'s arm (it polls the split)."""
    other = "colocated" if mode == "disaggregated" else "disaggregated"
    await set_split(cluster, Rollout({mode: 100.0}, rest=other))
    client = AsyncClient(cluster.router_address, timeout=60)
    try:

        async def followed() -> bool:
            before = await asyncio.to_thread(arm_requests, cluster, mode)
            await client.generate([5, 6, 7], max_tokens=2, ignore_eos=True)
            return await asyncio.to_thread(arm_requests, cluster, mode) > before

        await until(followed, f"the router to follow the {mode} split")
    finally:
        await client.close()


def running_on(c: Cluster, worker: ServiceProcess) -> int:
    port = f":{worker.port}"
    return sum(
        w.running_seqs
        for w in read_heartbeats(c.redis_url or "", c.namespace)
        if w.address.endswith(port)
    )


async def streaming(cluster: Cluster, batch: list[Job]) -> tuple[Load, list[asyncio.Task[Outcome]]]:
    """Start streaming ``batch``; return once every stream has tokens and a mixed worker
    reports running some."""
    load = Load(cluster.router_address)
    tasks = load.start(batch)
    mixed = cluster.workers("mixed")
    await until(
        lambda: load.all_past(batch, 2) and any(running_on(cluster, m) for m in mixed),
        "streams on a mixed worker",
    )
    return load, tasks


def test_sixteen_sim_workers_heartbeat_what_they_model(cluster: Cluster) -> None:
    beats = read_heartbeats(cluster.redis_url or "", cluster.namespace)
    assert sorted(w.role.value for w in beats) == ["mixed"] * MIXED + ["prefill"] * PREFILL
    assert len({w.model_fingerprint for w in beats}) == 1
    assert beats[0].model_fingerprint.startswith("sim-")
    # The pool is what an 80 GB H100 holds of Llama-3-8B's KV beside its weights.
    assert all(w.kv_blocks_total > 20_000 for w in beats)
    assert all(w.kv_bytes_per_token == MODELS["llama-3-8b"].kv_bytes_per_token for w in beats)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_streams_are_exact_in_each_mode(cluster: Cluster, engine: Engine, mode: str) -> None:
    batch = jobs(40 + len(mode), 16, prefix=mode[:5], max_tokens=48)
    expected = references(engine, batch)

    async def body() -> None:
        await follow_split(cluster, mode)
        load = Load(cluster.router_address)
        try:
            outcomes = await load.run(batch)
        finally:
            await load.client.close()
            await set_split(cluster, None)
        check(outcomes, batch, expected)
        moved = {o.transport for o in outcomes}
        if mode == "disaggregated":  # every prompt's KV crossed from a prefill worker
            assert "" not in moved and "recompute" not in moved, moved
        else:
            assert moved == {""}, moved
        await nothing_left(cluster, dead_pids=set())

    run(body)


def test_a_killed_decoding_worker_s_streams_migrate_exactly(
    cluster: Cluster, engine: Engine
) -> None:
    batch = jobs(7, 12, prefix="kill", max_tokens=LONG_STREAM)
    expected = references(engine, batch)
    mixed = cluster.workers("mixed")

    async def body() -> None:
        load, tasks = await streaming(cluster, batch)
        victim = max(mixed, key=lambda m: running_on(cluster, m))
        pid, _ = kill(victim)
        outcomes = list(await asyncio.gather(*tasks))
        await load.client.close()
        check(outcomes, batch, expected)
        await restarted(cluster, victim.name)
        await nothing_left(cluster, dead_pids={pid})

    run(body)


def test_a_duty_switch_under_load_loses_no_request(cluster: Cluster, engine: Engine) -> None:
    batch = jobs(8, 16, prefix="duty", max_tokens=LONG_STREAM)
    expected = references(engine, batch)
    keys = KeySpace(cluster.namespace)
    store = sync_redis.Redis.from_url(cluster.redis_url or "")
    mixed = cluster.workers("mixed")

    async def body() -> None:
        load, tasks = await streaming(cluster, batch)
        ports = {f":{m.port}" for m in mixed if running_on(cluster, m)}
        busy = [
            w
            for w in read_heartbeats(cluster.redis_url or "", cluster.namespace)
            if any(w.address.endswith(p) for p in ports)
        ]
        for w in busy[:4]:  # half the decoding side turns to prefill while it streams
            store.set(keys.duty(w.id), "prefill")
        outcomes = list(await asyncio.gather(*tasks))
        await load.client.close()
        check(outcomes, batch, expected)
        switched = {w.id for w in read_heartbeats(cluster.redis_url or "", cluster.namespace)}
        assert {w.id for w in busy[:4]} <= switched  # none of them died on the way

    try:
        run(body)
    finally:
        for w in read_heartbeats(cluster.redis_url or "", cluster.namespace):
            store.delete(keys.duty(w.id))
        store.close()
    run(lambda: nothing_left(cluster, dead_pids=set()))
