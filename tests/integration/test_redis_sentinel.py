"""Redis highly available under Sentinel: services given a ``redis+sentinel://`` URL follow
the master through a failover, the optimistic re-check (WATCH/MULTI) never commits across
it, and a cluster under load loses no request and leaves nothing behind.

Real processes throughout: a master, a replica and three sentinels (``sentinel_group``), the
cluster's services as child processes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, WatchError

from pdserve.engine.engine import Engine
from pdserve.launcher import read_heartbeats
from pdserve.scheduling.registry import connect
from tests.integration.failover_load import (
    Load,
    check,
    jobs,
    nothing_left,
    references,
    supervised,
    until,
)
from tests.integration.sentinel_group import SentinelGroup

pytestmark = pytest.mark.integration

PASSWORD = "sentinel-test-pw"


@pytest.fixture
def group() -> SentinelGroup:
    with SentinelGroup(password=PASSWORD) as g:
        yield g  # type: ignore[misc]


def test_a_client_follows_the_master_and_watch_never_commits_across_a_failover(
    group: SentinelGroup,
) -> None:
    async def body() -> None:
        redis = connect(group.url)
        try:
            await redis.set("counter", 1)
            assert await redis.wait(1, 2000) == 1  # the replica has it before the kill
            async with redis.pipeline() as pipe:
                await pipe.watch("counter")
                seen = int(await pipe.get("counter"))
                old = group.kill_master()
                pipe.multi()
                pipe.set("counter", seen + 1)
                # The WATCH lived on the dead master's connection: the transaction fails
                # rather than commit on a server that never saw the WATCH.
                with pytest.raises((RedisConnectionError, WatchError)):
                    await pipe.execute()
            new = await asyncio.to_thread(group.promoted, old)
            assert new != old

            async def retried() -> bool:  # the re-check starts over from a fresh read
                try:
                    async with redis.pipeline() as pipe:
                        await pipe.watch("counter")
                        value = int(await pipe.get("counter"))
                        pipe.multi()
                        pipe.set("counter", value + 1)
                        await pipe.execute()
                        return True
                except (RedisError, WatchError):
                    return False

            await until(retried, "a transaction on the new master")
            assert int(await redis.get("counter")) == 2
        finally:
            await redis.aclose()

    asyncio.run(body())


def test_a_cluster_rides_out_a_master_failover_under_load(
    group: SentinelGroup, tiny_llama_dir: Path
) -> None:
    """Streams in flight need no Redis; requests placed during the failover wait for the
    scheduler (the SDK retries UNAVAILABLE); the workers register on the new master at their
    next beat, and no reservation or block is left once the load is done."""
    engine = Engine.from_pretrained(tiny_llama_dir, dtype="float32")
    first, second = jobs(20, 6), jobs(21, 6)
    expected = references(engine, first + second)
    with supervised(tiny_llama_dir, redis_url=group.url) as c:

        async def body() -> None:
            load = Load(c.router_address)
            tasks = load.start(first)
            await until(lambda: load.all_past(first, 2), "streams under way")
            old = group.kill_master()
            tasks += load.start(second)
            new = await asyncio.to_thread(group.promoted, old)
            assert new != old
            check(list(await asyncio.gather(*tasks)), first + second, expected)
            # Every worker is in the new master's registry, nothing held anywhere.
            assert len(read_heartbeats(group.url, c.namespace)) == len(c.workers())
            await nothing_left(c, dead_pids=set())
            await load.client.close()

        asyncio.run(body())
