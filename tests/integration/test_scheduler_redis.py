"""The cluster scheduler against a real Redis, real processes and a real gRPC socket.

Every test works in its own key namespace of the session's Redis (see conftest.py). Waiting is
done by polling Redis or the process under test against a deadline, never by fixed sleeps.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from pdserve.errors import (
    CapacityError,
    KVTransferError,
    UnknownRequestError,
    WorkerUnavailableError,
)
from pdserve.redis_server import EmbeddedRedis
from pdserve.rpc.server import build_server
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.refresher import kept_fresh
from pdserve.scheduling.registry import Heartbeater, RedisWorkerRegistry, connect
from pdserve.scheduling.scheduler import ClusterScheduler, Mode
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK = 16
PROMPT, MAX_TOKENS = 20, 12
# Independent of the code under test: a request holds ceil((prompt + max_tokens) / block) blocks
# on its decode (or mixed) worker.
BLOCKS_PER_REQUEST = math.ceil((PROMPT + MAX_TOKENS) / BLOCK)


def make_worker(worker_id: str, role: WorkerRole, free_blocks: int, **overrides: Any) -> WorkerInfo:
    fields: dict[str, Any] = {
        "id": worker_id,
        "role": role,
        "address": f"127.0.0.1:{6000 + sum(map(ord, worker_id)) % 1000}",
        "host": "localhost",
        "model_fingerprint": "tiny-llama",
        "kv_blocks_total": max(free_blocks, 1000),
        "kv_blocks_free": free_blocks,
        "block_size": BLOCK,
        "max_batch_tokens": 4096,
    }
    fields.update(overrides)
    return WorkerInfo(**fields)


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10.0
) -> None:
    """Poll ``predicate`` until it holds; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


async def live_reserved_blocks(redis: Redis, keys: KeySpace, worker_id: str) -> int:
    """Sum of live reservation blocks on a worker, read straight from Redis."""
    seconds, micros = await redis.time()
    now_ms = seconds * 1000 + micros / 1000
    total = 0
    reply = await redis.zrange(keys.reservations_on(worker_id), 0, -1, withscores=True)
    # Members are "{reservation_id}|{tokens}|{blocks}" scored by expiry in ms (keys.py).
    for member, expiry in cast(list[tuple[bytes, float]], reply):
        if expiry > now_ms:
            total += int(member.decode().split("|")[2])
    return total


@pytest.fixture
def keys() -> KeySpace:
    return KeySpace(f"test-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def run(redis_url: str) -> Iterator[Callable[..., Any]]:
    """Run a coroutine function with a fresh Redis client: ``run(fn, *args)``."""

    def runner(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        async def main() -> Any:
            redis = connect(redis_url)
            try:
                return await fn(redis, *args)
            finally:
                await redis.aclose()

        return asyncio.run(main())

    yield runner


# -- EmbeddedRedis ------------------------------------------------------------------------------


def _process_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"  # a zombie has exited; only its parent's reaping is pending


def test_embedded_redis_stops_cleanly_and_can_restart_on_the_same_port() -> None:
    server = EmbeddedRedis().start()
    pid, port = server.pid, server.port
    assert pid is not None
    server.stop()
    assert _process_gone(pid)
    server.start()
    try:
        assert server.port == port and server.pid != pid
    finally:
        server.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_embedded_redis_dies_with_a_killed_parent() -> None:
    code = (
        "import sys; from pdserve.redis_server import EmbeddedRedis; "
        "r = EmbeddedRedis().start(); print(r.pid, flush=True); sys.stdin.read()"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    redis_pid = int(parent.stdout.readline())
    assert not _process_gone(redis_pid)
    parent.kill()  # SIGKILL: no finalizer or atexit hook runs in the parent
    parent.wait()

    async def gone() -> bool:
        return _process_gone(redis_pid)

    asyncio.run(wait_until(gone, "redis-server to exit after its parent was killed"))


# -- registry and heartbeats ----------------------------------------------------------------------


def test_heartbeater_publishes_with_ttl_and_deregisters_on_stop(run: Any, keys: KeySpace) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        info = make_worker("hb-0", WorkerRole.DECODE, 64)
        beater = Heartbeater(registry, lambda: info, interval_s=0.05)
        async with beater:

            async def registered() -> bool:
                return await registry.get("hb-0") is not None

            await wait_until(registered, "the first heartbeat")
            ttl_ms = await redis.pttl(keys.worker("hb-0"))
            assert 0 < ttl_ms <= 150  # three intervals by default
            listed = await registry.list_workers()
            assert [w.id for w in listed] == ["hb-0"]
            assert listed[0].ts > 0  # stamped at publication
        assert beater.beats >= 1 and beater.errors == 0
        assert await redis.exists(keys.worker("hb-0")) == 0

    run(scenario)


def test_heartbeater_survives_a_redis_restart(keys: KeySpace) -> None:
    async def scenario(server: EmbeddedRedis) -> None:
        redis = connect(server.url, timeout_s=0.5)
        registry = RedisWorkerRegistry(redis, keys=keys)
        info = make_worker("hb-1", WorkerRole.PREFILL, 64)
        beater = Heartbeater(registry, lambda: info, interval_s=0.05)
        beater.start()
        try:

            async def registered() -> bool:
                try:
                    return await registry.get("hb-1") is not None
                except RedisConnectionError:
                    return False  # Redis is restarting under us

            await wait_until(registered, "the first heartbeat")
            server.stop()  # the data goes with it

            async def failing() -> bool:
                return beater.errors > 0

            await wait_until(failing, "a failed heartbeat while Redis is down")
            server.start()  # same port, empty database
            await wait_until(registered, "the heartbeat to come back after the restart")
            assert beater.running
        finally:
            await beater.stop()
            await redis.aclose()

    with EmbeddedRedis() as server:
        asyncio.run(scenario(server))


def test_list_workers_drops_expired_and_unreadable_heartbeats(run: Any, keys: KeySpace) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        await registry.heartbeat(make_worker("short", WorkerRole.DECODE, 8), ttl_s=0.2)
        await registry.heartbeat(make_worker("long", WorkerRole.DECODE, 8), ttl_s=30)
        await redis.set(keys.worker("broken"), "{not json", ex=30)
        await redis.zadd(keys.worker_index, {"broken": time.time()})
        assert [w.id for w in await registry.list_workers()] == ["long", "short"]

        async def expired() -> bool:
            return await redis.exists(keys.worker("short")) == 0

        await wait_until(expired, "the short heartbeat to expire")
        assert [w.id for w in await registry.list_workers()] == ["long"]
        assert await registry.remove("long") is True
        assert await registry.list_workers() == []

    run(scenario)


def test_an_unchanged_heartbeat_is_not_parsed_again(run: Any, keys: KeySpace) -> None:
    """A scheduler lists the workers several times per heartbeat: the same heartbeat gives
    the same parsed object, a new one is read anew, and a worker gone is forgotten."""

    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        await registry.heartbeat(make_worker("a", WorkerRole.DECODE, 8), ttl_s=30)
        await registry.heartbeat(make_worker("b", WorkerRole.PREFILL, 8), ttl_s=30)
        first = {w.id: w for w in await registry.list_workers()}
        again = {w.id: w for w in await registry.list_workers()}
        assert all(again[i] is first[i] for i in ("a", "b"))
        await registry.heartbeat(make_worker("a", WorkerRole.DECODE, 7), ttl_s=30)
        third = {w.id: w for w in await registry.list_workers()}
        assert third["b"] is first["b"] and third["a"] is not first["a"]
        assert third["a"] == WorkerInfo.from_json(await redis.get(keys.worker("a")))
        assert await registry.remove("b")
        assert [w.id for w in await registry.list_workers()] == ["a"]

    run(scenario)


# -- the optimistic re-check under contention ----------------------------------------------------


def _hammer(
    url: str,
    namespace: str,
    modes: list[str],
    barrier: Any,
    results: Any,
) -> None:
    """One scheduler process: fire every request at once, report what was committed."""

    async def main() -> None:
        redis = connect(url)
        scheduler = ClusterScheduler(redis, keys=KeySpace(namespace), policy="least_loaded")
        await scheduler.snapshot()  # warm cache, so every process starts deciding at once
        barrier.wait()

        async def one(i: int, mode: str) -> tuple[str, str, str] | None:
            try:
                a = await scheduler.assign(
                    f"{os.getpid()}-{i}", PROMPT, MAX_TOKENS, mode=Mode(mode)
                )
            except CapacityError:
                return None
            return a.reservation_id, a.prefill.id, a.decode.id

        outcomes = await asyncio.gather(*(one(i, m) for i, m in enumerate(modes)))
        results.put(([o for o in outcomes if o is not None], scheduler.conflicts))
        await redis.aclose()

    asyncio.run(main())


def test_scheduler_processes_never_over_assign(redis_url: str, keys: KeySpace, run: Any) -> None:
    capacity = {"d1": 5, "d2": 3, "m1": 4}  # requests each worker can hold
    workers = [
        make_worker("p1", WorkerRole.PREFILL, 1000),
        make_worker("p2", WorkerRole.PREFILL, 1000),
        *(
            make_worker(
                wid,
                WorkerRole.MIXED if wid.startswith("m") else WorkerRole.DECODE,
                n * BLOCKS_PER_REQUEST,
            )
            for wid, n in capacity.items()
        ),
    ]

    async def publish(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        for w in workers:
            await registry.heartbeat(w, ttl_s=120)

    run(publish)
    processes, per_process = 4, 16
    modes = [Mode.DISAGGREGATED.value, Mode.COLOCATED.value] * (per_process // 2)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [
        ctx.Process(target=_hammer, args=(redis_url, keys.namespace, modes, barrier, results))
        for _ in range(processes)
    ]
    for p in procs:
        p.start()

    async def watch_invariant(redis: Redis) -> int:
        """Check live reservations <= capacity on every worker while the processes run."""
        samples = 0
        while any(p.is_alive() for p in procs) or samples == 0:
            for wid, n in capacity.items():
                held = await live_reserved_blocks(redis, keys, wid)
                assert held <= n * BLOCKS_PER_REQUEST, f"{wid} over-assigned: {held} blocks"
            samples += 1
            await asyncio.sleep(0.005)  # pacing only: leave the CPUs to the schedulers
        return samples

    try:
        run(watch_invariant)
        reports = [results.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
    assert all(p.exitcode == 0 for p in procs)

    committed = [c for outcomes, _ in reports for c in outcomes]
    assert len({rid for rid, _, _ in committed}) == len(committed)
    per_decode = Counter(decode for _, _, decode in committed)
    assert all(per_decode[w] <= n for w, n in capacity.items())
    assert all(prefill in ("p1", "p2") for _, prefill, d in committed if d != "m1")

    async def final_state(redis: Redis) -> tuple[dict[str, int], int]:
        held = {w: await live_reserved_blocks(redis, keys, w) for w in capacity}
        # Top up without contention: whatever the storm left free must still be placeable,
        # and then nothing more.
        scheduler = ClusterScheduler(redis, keys=keys)
        extra = 0
        for mode in (Mode.DISAGGREGATED, Mode.COLOCATED):
            while True:
                try:
                    await scheduler.assign("top-up", PROMPT, MAX_TOKENS, mode=mode)
                except CapacityError:
                    break
                extra += 1
        return held, extra

    held, extra = run(final_state)
    assert held == {w: per_decode[w] * BLOCKS_PER_REQUEST for w in capacity}
    assert len(committed) + extra == sum(capacity.values())
    assert len(committed) > 0


# -- liveness, expiry, draining ------------------------------------------------------------------


def test_expired_worker_is_not_chosen_even_from_a_stale_cache(run: Any, keys: KeySpace) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        await registry.heartbeat(make_worker("p", WorkerRole.PREFILL, 1000), ttl_s=60)
        await registry.heartbeat(make_worker("roomy", WorkerRole.DECODE, 500), ttl_s=0.3)
        await registry.heartbeat(make_worker("steady", WorkerRole.DECODE, 100), ttl_s=60)
        # A cache that never refreshes by age: only the re-check can notice the expiry.
        scheduler = ClusterScheduler(redis, keys=keys, refresh_interval_s=3600)
        first = await scheduler.assign("r0", PROMPT, MAX_TOKENS)
        assert first.decode.id == "roomy"  # least_loaded prefers it while it is alive

        async def expired() -> bool:
            return await redis.exists(keys.worker("roomy")) == 0

        await wait_until(expired, "the roomy worker's heartbeat to expire")
        later = [await scheduler.assign(f"r{i}", PROMPT, MAX_TOKENS) for i in range(1, 4)]
        assert [a.decode.id for a in later] == ["steady"] * 3
        assert "roomy" not in [v.id for v in await scheduler.snapshot()]

    run(scenario)


REFRESH_TASK = "scheduler-view-refresh"


def test_kept_fresh_refreshes_the_view_without_any_decision(run: Any, keys: KeySpace) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        scheduler = ClusterScheduler(redis, keys=keys, refresh_interval_s=0.2)
        async with kept_fresh(scheduler):
            await registry.heartbeat(make_worker("late", WorkerRole.DECODE, 100), ttl_s=60)

            async def seen() -> bool:
                # A view of any age: reading it never refreshes it, only the task does.
                return "late" in [v.id for v in await scheduler.snapshot(max_age_s=math.inf)]

            await wait_until(seen, "the background refresh to see the new worker")
        # Leaving stops the task (cancelled and awaited): nothing refreshes the view any more.
        assert not [t for t in asyncio.all_tasks() if t.get_name() == REFRESH_TASK]

    run(scenario)


def test_kept_fresh_outlives_an_unreachable_redis(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        redis = connect("redis://127.0.0.1:1/0", timeout_s=0.5, retries=0)  # nobody listens
        scheduler = ClusterScheduler(redis, keys=KeySpace("unreachable"), refresh_interval_s=0.02)
        try:
            async with kept_fresh(scheduler):

                async def warned() -> bool:
                    return any("cannot refresh" in r.getMessage() for r in caplog.records)

                await wait_until(warned, "the refresh task to report the outage")
                (task,) = [t for t in asyncio.all_tasks() if t.get_name() == REFRESH_TASK]
                assert not task.done()  # still trying
            assert task.cancelled()
        finally:
            await redis.aclose()

    with caplog.at_level("WARNING", logger="pdserve.scheduling.refresher"):
        asyncio.run(scenario())
    assert sum("cannot refresh" in r.getMessage() for r in caplog.records) == 1  # once per outage


def test_orphaned_reservation_expires_and_frees_capacity(run: Any, keys: KeySpace) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        await registry.heartbeat(make_worker("p", WorkerRole.PREFILL, 1000), ttl_s=60)
        await registry.heartbeat(make_worker("d", WorkerRole.DECODE, BLOCKS_PER_REQUEST), ttl_s=60)
        scheduler = ClusterScheduler(redis, keys=keys, reservation_ttl_s=0.3)
        orphan = await scheduler.assign("orphan", PROMPT, MAX_TOKENS)  # never released
        with pytest.raises(CapacityError, match="every decode worker is full"):
            await scheduler.assign("blocked", PROMPT, MAX_TOKENS)

        async def expired() -> bool:
            return await redis.exists(keys.reservation(orphan.reservation_id)) == 0

        await wait_until(expired, "the orphaned reservation to expire")
        assert await live_reserved_blocks(redis, keys, "d") == 0
        again = await scheduler.assign("after", PROMPT, MAX_TOKENS)
        assert again.decode.id == "d"
        with pytest.raises(UnknownRequestError):
            await scheduler.renew(orphan.reservation_id)

    run(scenario)


def test_renew_keeps_a_reservation_past_its_ttl(run: Any, keys: KeySpace) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        await registry.heartbeat(make_worker("p", WorkerRole.PREFILL, 1000), ttl_s=60)
        await registry.heartbeat(make_worker("d", WorkerRole.DECODE, 100), ttl_s=60)
        ttl_s = 0.3
        scheduler = ClusterScheduler(redis, keys=keys, reservation_ttl_s=ttl_s)
        a = await scheduler.assign("long", PROMPT, MAX_TOKENS)
        start_s, _ = await redis.time()
        while (await redis.time())[0] - start_s < 3 * ttl_s + 1:  # Redis clock, whole seconds
            assert await scheduler.renew(a.reservation_id) == ttl_s
            await asyncio.sleep(ttl_s / 4)  # the passage of time is what is under test
        assert await live_reserved_blocks(redis, keys, "d") == BLOCKS_PER_REQUEST
        assert await scheduler.release(a.reservation_id) is True

    run(scenario)


def test_draining_worker_is_not_chosen(run: Any, keys: KeySpace) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        await registry.heartbeat(make_worker("m-drain", WorkerRole.MIXED, 900, draining=True), 60)
        await registry.heartbeat(make_worker("m-ok", WorkerRole.MIXED, 50), 60)
        scheduler = ClusterScheduler(redis, keys=keys, default_mode=Mode.COLOCATED)
        chosen = [(await scheduler.assign(f"r{i}", PROMPT, MAX_TOKENS)).decode.id for i in range(3)]
        assert chosen == ["m-ok"] * 3
        await registry.remove("m-ok")
        with pytest.raises(WorkerUnavailableError, match="no live, non-draining mixed worker"):
            await scheduler.assign("none-left", PROMPT, MAX_TOKENS)

    run(scenario)


def test_admitted_reservations_are_not_counted_twice(run: Any, keys: KeySpace) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        await registry.heartbeat(make_worker("p", WorkerRole.PREFILL, 1000), ttl_s=60)
        room = 2 * BLOCKS_PER_REQUEST
        await registry.heartbeat(make_worker("d", WorkerRole.DECODE, room), ttl_s=60)
        scheduler = ClusterScheduler(redis, keys=keys, refresh_interval_s=0)
        first = await scheduler.assign("r1", PROMPT, MAX_TOKENS)
        # The worker admits r1: its blocks are now in use and its heartbeat says so.
        admitted = make_worker(
            "d",
            WorkerRole.DECODE,
            room - BLOCKS_PER_REQUEST,
            kv_blocks_total=room,
            reservations=(first.reservation_id,),
        )
        await registry.heartbeat(admitted, ttl_s=60)
        second = await scheduler.assign("r2", PROMPT, MAX_TOKENS)
        assert second.decode.id == "d"
        with pytest.raises(CapacityError):
            await scheduler.assign("r3", PROMPT, MAX_TOKENS)

    run(scenario)


def test_release_returns_capacity_prefill_share_first(run: Any, keys: KeySpace) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        await registry.heartbeat(make_worker("p", WorkerRole.PREFILL, 1000), ttl_s=60)
        await registry.heartbeat(make_worker("d", WorkerRole.DECODE, 100), ttl_s=60)
        scheduler = ClusterScheduler(redis, keys=keys)
        a = await scheduler.assign("r", PROMPT, MAX_TOKENS)
        prompt_blocks = math.ceil(PROMPT / BLOCK)
        assert await live_reserved_blocks(redis, keys, "p") == prompt_blocks
        assert await scheduler.release(a.reservation_id, prefill_only=True) is True
        assert await live_reserved_blocks(redis, keys, "p") == 0
        assert await live_reserved_blocks(redis, keys, "d") == BLOCKS_PER_REQUEST
        assert await scheduler.release(a.reservation_id) is True
        assert await live_reserved_blocks(redis, keys, "d") == 0
        assert await scheduler.release(a.reservation_id) is False
        assert await redis.exists(keys.reservation(a.reservation_id)) == 0

    run(scenario)


def test_prefill_must_share_the_decode_workers_model(run: Any, keys: KeySpace) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        await registry.heartbeat(
            make_worker("p-old", WorkerRole.PREFILL, 1000, model_fingerprint="v1"), 60
        )
        await registry.heartbeat(
            make_worker("d-new", WorkerRole.DECODE, 100, model_fingerprint="v2"), 60
        )
        scheduler = ClusterScheduler(redis, keys=keys)
        with pytest.raises(CapacityError, match="model differs"):
            await scheduler.assign("r", PROMPT, MAX_TOKENS)
        await registry.heartbeat(
            make_worker("p-new", WorkerRole.PREFILL, 10, model_fingerprint="v2"), 60
        )
        assert (await scheduler.assign("r", PROMPT, MAX_TOKENS)).prefill.id == "p-new"

    run(scenario)


# -- the gRPC service ----------------------------------------------------------------------------


@pytest.fixture
def scheduler_service(redis_url: str, keys: KeySpace, tmp_path: Path) -> Iterator[str]:
    """``python -m services.scheduler`` on a free port; yields its address."""
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "services.scheduler",
            "--port", "0", "--port-file", str(port_file),
            "--redis-url", redis_url, "--namespace", keys.namespace,
            "--log-level", "WARNING", "--reflection",
        ],
        cwd=REPO_ROOT,
    )  # fmt: skip
    try:

        async def ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"scheduler exited with status {proc.returncode}")
            return port_file.exists()

        asyncio.run(wait_until(ready, "the scheduler to write its port file", timeout_s=30))
        yield f"127.0.0.1:{int(port_file.read_text())}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_scheduler_service_over_grpc(run: Any, keys: KeySpace, scheduler_service: str) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        prefill = make_worker("p", WorkerRole.PREFILL, 1000)
        decode = make_worker("d", WorkerRole.DECODE, BLOCKS_PER_REQUEST)
        for w in (prefill, decode):
            await registry.heartbeat(w, ttl_s=60)
        async with grpc.aio.insecure_channel(scheduler_service) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "pdserve.v1.Scheduler"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            request = scheduler_pb2.AssignRequest(
                request_id="grpc-1", prompt_tokens=PROMPT, max_tokens=MAX_TOKENS
            )
            a = await stub.Assign(request)
            assert (a.prefill.id, a.prefill.address) == ("p", prefill.address)
            assert (a.decode.id, a.decode.address, a.decode.host) == (
                "d",
                decode.address,
                "localhost",
            )
            assert a.mode == common_pb2.MODE_DISAGGREGATED and a.policy == "kv_aware"

            listed = await stub.ListWorkers(
                scheduler_pb2.ListWorkersRequest(role=common_pb2.WORKER_ROLE_DECODE)
            )
            assert [(w.id, w.reserved_blocks) for w in listed.workers] == [
                ("d", BLOCKS_PER_REQUEST)
            ]

            with pytest.raises(grpc.aio.AioRpcError) as full:
                await stub.Assign(request)
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.Assign(scheduler_pb2.AssignRequest(request_id="x", max_tokens=1))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt_tokens" in (bad.value.details() or "")

            renewed = await stub.Renew(scheduler_pb2.RenewRequest(reservation_id=a.reservation_id))
            assert renewed.ttl_s > 0
            released = await stub.Release(
                scheduler_pb2.ReleaseRequest(reservation_id=a.reservation_id)
            )
            assert released.released
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await stub.Renew(scheduler_pb2.RenewRequest(reservation_id=a.reservation_id))
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND

            services = await _reflected_services(channel)
            assert {"pdserve.v1.Scheduler", "grpc.health.v1.Health"} <= services

    run(scenario)


async def _reflected_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def one_request() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    async for reply in stub.ServerReflectionInfo(one_request()):
        return {s.name for s in reply.list_services_response.service}
    return set()


# -- the shared error interceptor on a streaming method ------------------------------------------


class _FailingDecode(decode_pb2_grpc.DecodeServicer):
    """Streams one chunk, then fails the way the request id asks."""

    async def Decode(  # noqa: N802
        self, request: decode_pb2.DecodeRequest, context: Any
    ) -> AsyncIterator[decode_pb2.DecodeChunk]:
        yield decode_pb2.DecodeChunk(token_ids=[7])
        if request.request_id == "typed":
            raise KVTransferError("checksum mismatch on block 3")
        raise RuntimeError("boom")


def test_error_interceptor_maps_streaming_failures() -> None:
    async def scenario() -> None:
        server, port, health = build_server(
            [(decode_pb2_grpc.add_DecodeServicer_to_server, _FailingDecode())], port=0
        )
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="pdserve.v1.Decode")
                )
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # not yet set
                await health.set_serving()
                stub = decode_pb2_grpc.DecodeStub(channel)
                for request_id, code, text in [
                    ("typed", grpc.StatusCode.UNAVAILABLE, "checksum mismatch on block 3"),
                    ("untyped", grpc.StatusCode.INTERNAL, "RuntimeError: boom"),
                ]:
                    call = stub.Decode(decode_pb2.DecodeRequest(request_id=request_id))
                    chunks = []
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for chunk in call:
                            chunks.append(list(chunk.token_ids))
                    assert chunks == [[7]]
                    assert err.value.code() == code
                    assert text in (err.value.details() or "")
        finally:
            await server.stop(None)

    asyncio.run(scenario())
