"""SIGKILL of each kind of process under load, on a supervised cluster (``pdserve up``'s
``Cluster(supervise=True)``) with two prefill and two decode workers.

Each test streams greedy and seeded sampled requests through the SDK, kills one process while
they run, and checks that every stream equals the engine's own output (no token lost or
repeated, same text, same usage), that the supervisor brought the process back on its
address, and that afterwards no KV block, hand-off entry, shm segment or reservation is left.
Worker deaths must show in the scheduler's view within two heartbeat intervals.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.engine import Engine
from pdserve.kvstore.client import KVStoreClient
from pdserve.launcher import Cluster, read_heartbeats
from pdserve.service_process import ServiceProcess
from pdserve.supervisor import REDIS, RestartPolicy
from pdserve.transfer.janitor import SHM_DIR, SegmentState, parse_owner_pid, segment_state
from tests.integration.failover_load import (
    LONG_STREAM,
    NO_RETRY,
    RESTARTS,
    WORKER_ARGS,
    Load,
    check,
    detected,
    jobs,
    kill,
    nothing_left,
    references,
    restarted,
    supervised,
    until,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=256)


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=240))


def running_on(c: Cluster, worker: ServiceProcess) -> int:
    """Sequences the worker's last heartbeat says it runs."""
    port = f":{worker.port}"
    beats = read_heartbeats(c.redis_url or "", c.namespace)
    return sum(w.running_seqs for w in beats if w.address.endswith(port))


def test_decode_worker_killed_mid_stream(tiny_llama_dir: Path, engine: Engine) -> None:
    """Its streams migrate to the other decode worker and go on where they were."""
    batch = jobs(1, 8, max_tokens=LONG_STREAM)
    expected = references(engine, batch)
    with supervised(tiny_llama_dir) as c:
        decodes = c.workers("decode")

        async def body() -> None:
            load = Load(c.router_address)
            tasks = load.start(batch)
            await until(
                lambda: load.all_past(batch, 2) and any(running_on(c, d) for d in decodes),
                "streams on a decode worker",
            )
            victim = max(decodes, key=lambda d: running_on(c, d))  # the other one is spare
            pid, killed_at = kill(victim)
            watch = asyncio.create_task(detected(c, victim, killed_at))
            outcomes = list(await asyncio.gather(*tasks))
            check(outcomes, batch, expected)
            # The moved streams were finished by a worker that recomputed what they had.
            assert any(o.transport == "recompute" for o in outcomes)
            await watch
            await restarted(c, victim.name)
            await nothing_left(c, dead_pids={pid})
            await load.client.close()

        run(body)


def test_mixed_worker_killed_mid_stream(tiny_llama_dir: Path, engine: Engine) -> None:
    """Colocated: the streams of a dead mixed worker move to the other one the same way."""
    batch = jobs(12, 6, max_tokens=LONG_STREAM)
    expected = references(engine, batch)
    with supervised(tiny_llama_dir, mode="colocated") as c:
        mixed = c.workers("mixed")

        async def body() -> None:
            load = Load(c.router_address)
            tasks = load.start(batch)
            await until(
                lambda: load.all_past(batch, 2) and any(running_on(c, m) for m in mixed),
                "streams on a mixed worker",
            )
            victim = max(mixed, key=lambda m: running_on(c, m))
            pid, killed_at = kill(victim)
            watch = asyncio.create_task(detected(c, victim, killed_at))
            outcomes = list(await asyncio.gather(*tasks))
            check(outcomes, batch, expected)
            assert any(o.transport == "recompute" for o in outcomes)
            await watch
            await restarted(c, victim.name)
            await nothing_left(c, dead_pids={pid})
            await load.client.close()

        run(body)


def test_prefill_worker_killed_with_hand_offs_in_flight(
    tiny_llama_dir: Path, engine: Engine
) -> None:
    """Its Prefill calls fail; the router places them again on the other prefill worker. The
    dead worker's shm slots are reclaimed."""
    batch = jobs(2, 6, prefix="slow") + jobs(3, 6)
    expected = references(engine, batch)
    with supervised(tiny_llama_dir) as c:
        prefills = {s.proc.pid: s for s in c.workers("prefill") if s.proc is not None}

        def writing() -> dict[int, int]:
            counts = dict.fromkeys(prefills, 0)
            for path in SHM_DIR.glob("pdserve-kv-*"):
                owner = parse_owner_pid(path.name)
                if owner in counts and segment_state(path) is SegmentState.WRITING:
                    counts[owner] += 1
            return counts

        async def body() -> None:
            load = Load(c.router_address)
            tasks = load.start(batch)

            await until(lambda: sum(writing().values()) >= 3, "stalled shm hand-offs")
            counts = writing()
            victim = prefills[max(counts, key=lambda pid: counts[pid])]
            assert counts[victim.proc.pid] > 0  # type: ignore[union-attr]
            pid, killed_at = kill(victim)
            watch = asyncio.create_task(detected(c, victim, killed_at))
            outcomes = list(await asyncio.gather(*tasks))
            check(outcomes, batch, expected)
            await watch
            await restarted(c, victim.name)
            await nothing_left(c, dead_pids={pid})
            await load.client.close()

        run(body)


def test_kvstore_killed_and_restarted(tiny_llama_dir: Path, engine: Engine) -> None:
    """Hand-offs through the store fall back to recompute while it is gone; the restarted
    store (same address) carries hand-offs again."""
    batch = jobs(4, 4, prefix="slow") + jobs(5, 6)
    expected = references(engine, batch)
    after = jobs(6, 1)
    expected.update(references(engine, after))
    with supervised(tiny_llama_dir, worker_args=(*WORKER_ARGS, "--transport", "store")) as c:
        store = next(s for s in c.services if s.name == "kvstore")

        async def writing() -> bool:
            async with KVStoreClient(c.kvstore_address, timeout_s=5) as client:
                totals = (await client.stat()).totals
            return totals is not None and totals.num_writing >= 3

        async def body() -> None:
            load = Load(c.router_address)
            tasks = load.start(batch)
            await until(writing, "stalled puts into the store")
            pid, _ = kill(store)
            check(list(await asyncio.gather(*tasks)), batch, expected)
            await restarted(c, "kvstore")

            async def through_the_store() -> bool:
                (outcome,) = await load.run(after)
                check([outcome], after, expected)
                return outcome.transport == "store"

            await until(through_the_store, "a hand-off through the restarted store")
            await nothing_left(c, dead_pids={pid})
            await load.client.close()

        run(body)


def test_scheduler_killed_under_load(tiny_llama_dir: Path, engine: Engine) -> None:
    """Streams in flight finish; requests that arrive while it is down wait in the router
    (their clients retry nothing) until the scheduler the supervisor restarted places them."""
    first, second = jobs(7, 6), jobs(8, 6)
    expected = references(engine, first + second)
    # Longer than the default 10 s: a process start on a busy test machine takes its time.
    with supervised(tiny_llama_dir, router_args=("--scheduler-wait-s", "60")) as c:
        scheduler = next(s for s in c.services if s.name == "scheduler")

        async def body() -> None:
            load = Load(c.router_address, retry=NO_RETRY)
            tasks = load.start(first)
            await until(lambda: load.all_past(first, 2), "streams under way")
            pid, _ = kill(scheduler)
            tasks += load.start(second)  # these meet the outage at Assign
            check(list(await asyncio.gather(*tasks)), first + second, expected)
            await restarted(c, "scheduler")
            await nothing_left(c, dead_pids={pid})
            await load.client.close()

        run(body)


def test_router_killed_under_load(tiny_llama_dir: Path, engine: Engine) -> None:
    """Without a second router its streams break; clients that start them over are served by
    the restarted router (same port). The workers free what the dead router's calls held;
    its reservations and hand-offs expire."""
    batch = jobs(9, 8)
    expected = references(engine, batch)
    with supervised(tiny_llama_dir) as c:
        router = next(s for s in c.services if s.name == "router")

        async def body() -> None:
            load = Load(c.router_address, restart_broken=True)
            tasks = load.start(batch)
            await until(lambda: load.all_past(batch, 2), "streams under way")
            pid, _ = kill(router)
            outcomes = list(await asyncio.gather(*tasks))
            check(outcomes, batch, expected)
            assert any(o.restarts for o in outcomes)  # some streams did break
            await restarted(c, "router")
            await nothing_left(c, dead_pids={pid})
            await load.client.close()

        run(body)


def test_redis_killed_under_load(tiny_llama_dir: Path, engine: Engine) -> None:
    """Streams in flight finish without Redis; the scheduler says NOT_SERVING until the
    restarted Redis (same port, empty) is back, the workers register again, and requests
    retried meanwhile are placed. The lost reservations leave nothing behind."""
    first, second = jobs(10, 6), jobs(11, 6)
    expected = references(engine, first + second)
    # A slower restart, so that the outage is long enough to be seen.
    slow = RestartPolicy(initial_backoff_s=2.0, poll_s=RESTARTS.poll_s)
    with supervised(tiny_llama_dir, restart_policy=slow) as c:
        redis = c.embedded_redis
        assert redis is not None and redis.pid is not None

        def scheduler_health() -> int:
            return int(_health(c.scheduler_address))

        async def body() -> None:
            load = Load(c.router_address)
            tasks = load.start(first)
            await until(lambda: load.all_past(first, 2), "streams under way")
            os.kill(redis.pid, signal.SIGKILL)  # type: ignore[arg-type]
            tasks += load.start(second)
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            await until(lambda: scheduler_health() == not_serving, "the scheduler to say so")
            check(list(await asyncio.gather(*tasks)), first + second, expected)
            assert c.supervisor is not None and c.supervisor.restarts(REDIS) == 1
            assert scheduler_health() == health_pb2.HealthCheckResponse.SERVING
            await nothing_left(c, dead_pids=set())  # every worker is registered again
            await load.client.close()

        run(body)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=2
        )
    return int(reply.status)
