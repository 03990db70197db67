"""The scheduler when workers or Redis fail: exclusions, decode-only placements (migrations),
stale heartbeats, and health that follows Redis. Real Redis, real processes, no fixed sleeps."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.asyncio import Redis

from pdserve.errors import WorkerUnavailableError
from pdserve.redis_server import EmbeddedRedis
from pdserve.scheduling.capacity import STALE_AFTER_INTERVALS
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.registry import RedisWorkerRegistry
from pdserve.scheduling.scheduler import ClusterScheduler
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.integration.test_scheduler_redis import (
    BLOCKS_PER_REQUEST,
    MAX_TOKENS,
    PROMPT,
    REPO_ROOT,
    keys,
    live_reserved_blocks,
    make_worker,
    run,
    wait_until,
)

pytestmark = pytest.mark.integration
__all__ = ["keys", "run"]  # fixtures


def test_excluded_workers_are_not_chosen(run: Any, keys: KeySpace) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        for w in (
            make_worker("p1", WorkerRole.PREFILL, 1000),
            make_worker("p2", WorkerRole.PREFILL, 1000),
            make_worker("roomy", WorkerRole.DECODE, 500),
            make_worker("small", WorkerRole.DECODE, 100),
        ):
            await registry.heartbeat(w, ttl_s=60)
        scheduler = ClusterScheduler(redis, keys=keys)
        first = await scheduler.assign("r", PROMPT, MAX_TOKENS)
        assert first.decode.id == "roomy"
        retry = await scheduler.assign("r", PROMPT, MAX_TOKENS, exclude=[first.prefill.id, "roomy"])
        assert retry.decode.id == "small" and retry.prefill.id != first.prefill.id
        with pytest.raises(WorkerUnavailableError, match="no live, non-draining decode worker"):
            await scheduler.assign("r", PROMPT, MAX_TOKENS, exclude=["roomy", "small"])

    run(scenario)


def test_decode_only_reserves_the_decode_worker_alone(run: Any, keys: KeySpace) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        await registry.heartbeat(make_worker("p", WorkerRole.PREFILL, 1000), ttl_s=60)
        await registry.heartbeat(make_worker("dead", WorkerRole.DECODE, 500), ttl_s=60)
        await registry.heartbeat(make_worker("spare", WorkerRole.DECODE, 100), ttl_s=60)
        scheduler = ClusterScheduler(redis, keys=keys)
        moved = await scheduler.assign("r", PROMPT, MAX_TOKENS, exclude=["dead"], decode_only=True)
        assert moved.decode.id == moved.prefill.id == "spare"
        assert await live_reserved_blocks(redis, keys, "spare") == BLOCKS_PER_REQUEST
        assert await live_reserved_blocks(redis, keys, "p") == 0  # nothing to prefill
        assert await scheduler.release(moved.reservation_id, prefill_only=True) is False
        assert await scheduler.release(moved.reservation_id) is True
        assert await live_reserved_blocks(redis, keys, "spare") == 0

    run(scenario)


def test_a_worker_two_heartbeats_late_is_gone_before_its_key_expires(
    run: Any, keys: KeySpace
) -> None:
    async def scenario(redis: Redis) -> None:
        registry = RedisWorkerRegistry(redis, keys=keys)
        interval = 0.5
        late_by = (STALE_AFTER_INTERVALS + 1) * interval
        await registry.heartbeat(make_worker("p", WorkerRole.PREFILL, 1000), ttl_s=60)
        # Its key lives a minute, but the beat it carries is three intervals old.
        late = make_worker(
            "late", WorkerRole.DECODE, 900, interval_s=interval, ts=time.time() - late_by
        )
        await registry.heartbeat(late, ttl_s=60)
        await registry.heartbeat(
            make_worker("fresh", WorkerRole.DECODE, 100, interval_s=interval), ttl_s=60
        )
        scheduler = ClusterScheduler(redis, keys=keys, refresh_interval_s=0)
        assert [v.id for v in await scheduler.snapshot()] == ["fresh", "p"]
        assert (await scheduler.assign("r", PROMPT, MAX_TOKENS)).decode.id == "fresh"
        # The same worker beating again is back at once.
        await registry.heartbeat(
            make_worker("late", WorkerRole.DECODE, 900, interval_s=interval), 60
        )
        assert (await scheduler.assign("r2", PROMPT, MAX_TOKENS)).decode.id == "late"

    run(scenario)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="pdserve.v1.Scheduler"), timeout=2
            )
        except grpc.RpcError:
            return -1
    return int(reply.status)


def test_scheduler_health_follows_redis(tmp_path: Path) -> None:
    """NOT_SERVING while its Redis is down, SERVING again once it is back (same port, empty),
    and placing on workers that registered again."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    with EmbeddedRedis() as server:
        port_file = tmp_path / "port"
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "services.scheduler", "--port", "0",
                "--port-file", str(port_file), "--redis-url", server.url,
                "--refresh-interval-s", "0.1", "--log-level", "WARNING",
            ],
            cwd=REPO_ROOT,
        )  # fmt: skip
        try:

            async def scenario() -> None:
                async def ready() -> bool:
                    assert proc.poll() is None, f"scheduler exited ({proc.returncode})"
                    return port_file.exists()

                await wait_until(ready, "the scheduler's port file", timeout_s=30)
                address = f"127.0.0.1:{int(port_file.read_text())}"

                async def health_is(status: int) -> bool:
                    return await asyncio.to_thread(_health, address) == status

                await wait_until(lambda: health_is(serving), "SERVING")
                server.stop()
                await wait_until(lambda: health_is(not_serving), "NOT_SERVING without Redis")
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = scheduler_pb2_grpc.SchedulerStub(channel)
                    request = scheduler_pb2.AssignRequest(
                        request_id="r", prompt_tokens=PROMPT, max_tokens=MAX_TOKENS
                    )
                    with pytest.raises(grpc.aio.AioRpcError) as down:
                        await stub.Assign(request)
                    assert down.value.code() == grpc.StatusCode.UNAVAILABLE
                    server.start()  # same port, nothing in it
                    await wait_until(lambda: health_is(serving), "SERVING after the restart")
                    redis = Redis.from_url(server.url)
                    try:
                        registry = RedisWorkerRegistry(redis, keys=KeySpace())
                        await registry.heartbeat(make_worker("p", WorkerRole.PREFILL, 10), 60)
                        await registry.heartbeat(make_worker("d", WorkerRole.DECODE, 10), 60)
                    finally:
                        await redis.aclose()
                    placed = await stub.Assign(request)
                    assert (placed.prefill.id, placed.decode.id) == ("p", "d")

            asyncio.run(scenario())
        finally:
            proc.kill()
            proc.wait()
