"""Scheduler replicas at the router: the address list and the turn each call takes."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.router.channels import ChannelPool
from pdserve.router.schedulers import SchedulerReplicas, parse_replicas


def test_the_list_is_comma_separated_and_checked() -> None:
    assert parse_replicas("a:1") == ("a:1",)
    assert parse_replicas(" a:1, b:2 ,") == ("a:1", "b:2")
    assert parse_replicas(["a:1", "b:2"]) == ("a:1", "b:2")
    for bad in ("", " , ", "a:1,a:1"):
        with pytest.raises(InvalidArgumentError) as err:
            parse_replicas(bad)
        assert err.value.field == "--scheduler"


def test_each_call_asks_the_next_replica() -> None:
    async def body() -> list[str]:
        pool = ChannelPool(interceptors=[])
        replicas = SchedulerReplicas("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", pool)
        asked = []
        for _ in range(7):
            replicas.stub()
            asked.append(next(reversed(pool._channels)))  # the channel just used
        await pool.close()
        return asked

    asked = asyncio.run(body())
    assert asked == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"] * 2 + ["127.0.0.1:1"]
