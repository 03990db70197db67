"""Scheduling in a real cluster on the tiny preset: KV events reaching the scheduler's index
and steering placement, a duty switch that drains first and loses nothing, the rollout split
followed by the router, and the planner's leader lease and moves against a real Redis.

Waiting is polling against a deadline (heartbeats, the scheduler's worker list, metrics),
never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis as sync_redis

from pdserve.client import AsyncClient, Client
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import CapacityError
from pdserve.launcher import Cluster, read_heartbeats
from pdserve.models.demo import init_checkpoint
from pdserve.router.rollout import Rollout, write_rollout
from pdserve.scheduling.capacity import CapacityLimits
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.planner import LeaderLease, PlannerConfig
from pdserve.scheduling.planner_loop import PlannerLoop
from pdserve.scheduling.registry import RedisWorkerRegistry, connect
from pdserve.scheduling.scheduler import ClusterScheduler, Mode
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole
from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.integration.metrics_probe import metric

pytestmark = pytest.mark.integration

WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
               "--heartbeat-interval-s", "0.2")  # fmt: skip
DEADLINE_S = 60.0


def poll(check: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S) -> Any:
    """Call ``check`` until it returns something truthy; fail naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)  # a poll interval against the deadline, not synchronisation
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(tmp_path_factory.mktemp("sched_model"), "tiny", dtype="float32")


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[Cluster]:
    """Two mixed workers with a KV store: each can prefill, decode and serve colocated."""
    with Cluster(
        model_dir, mode="conditional", num_prefill=0, num_decode=2, worker_args=WORKER_ARGS
    ) as c:
        yield c


def listed(cluster: Cluster) -> dict[str, scheduler_pb2.WorkerStatus]:
    with grpc.insecure_channel(cluster.scheduler_address) as channel:
        reply = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=10
        )
    return {w.id: w for w in reply.workers}


def idle(cluster: Cluster) -> bool:
    """No worker decodes, queues or holds a reservation in the scheduler's view."""
    return not any(
        w.running_seqs or w.queued_tokens or w.reserved_tokens for w in listed(cluster).values()
    )


def test_kv_events_reach_the_index_and_a_follow_up_finds_its_prefix(cluster: Cluster) -> None:
    # Long enough that the cached history outweighs any difference in the two workers' load
    # (the placement weighs predicted time to the first token, cache hits included).
    history = list(range(100, 100 + 1000))
    blocks = len(history) // 16
    with Client(cluster.router_address, timeout=60) as client:
        first = client.generate(history, max_tokens=4, temperature=0, ignore_eos=True)
        assert first.usage.cached_tokens == 0
        # The blocks the first request left behind appear in the scheduler's index, and its
        # reservation is gone.
        poll(lambda: any(w.indexed_blocks >= blocks for w in listed(cluster).values())
             and not any(w.reserved_tokens for w in listed(cluster).values()),
             "the scheduler's index to hold the first prompt's blocks")  # fmt: skip
        follow_up = [*history, *first.token_ids, *range(50, 70)]
        for _ in range(3):
            # The scheduler's view shows the finished stream gone: a worker it still sees
            # decoding is rightly spared a prefill that would stall that stream.
            poll(lambda: idle(cluster), "the scheduler to see every worker idle")
            again = client.generate(follow_up, max_tokens=4, temperature=0, ignore_eos=True)
            # KV-aware placement sent it to the worker holding the history: every block hit.
            assert again.usage.cached_tokens >= blocks * 16


def test_a_duty_switch_migrates_the_streams_and_loses_nothing(
    cluster: Cluster, model_dir: Path
) -> None:
    """Leaving decode duty (``--duty-switch migrate``, the default), a worker hands its
    stream back at once: it completes its switch while the stream goes on, migrated to the
    other worker, token for token."""
    prompt = list(range(200, 230))
    expected = (
        Engine.from_pretrained(model_dir, dtype="float32")
        .generate(prompt, SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True))[0]
        .token_ids
    )
    assert cluster.redis_url is not None
    url, keys = cluster.redis_url, KeySpace(cluster.namespace)
    store = sync_redis.Redis.from_url(url)

    def switched(w: WorkerInfo) -> bool:
        return w.duty == "prefill" and not w.switching and w.running_seqs == 0

    def running_elsewhere(worker_id: str) -> list[WorkerInfo]:
        return [w for w in read_heartbeats(url, cluster.namespace)
                if w.id != worker_id and w.running_seqs]  # fmt: skip

    async def scenario() -> list[int]:
        tokens: list[int] = []
        async with AsyncClient(cluster.router_address, timeout=120) as client:
            stream = client.stream(prompt, max_tokens=1500, temperature=0, ignore_eos=True)
            async with stream:
                async for delta in stream:
                    if not tokens:
                        busy = await asyncio.to_thread(_decoding_worker, cluster)
                        store.set(keys.duty(busy.id), "prefill")
                        await asyncio.to_thread(_heartbeat_of, cluster, busy.id, switched)
                        # A drain would end the switch only with the stream; it runs on.
                        elsewhere = functools.partial(running_elsewhere, busy.id)
                        await asyncio.to_thread(poll, elsewhere, "the stream elsewhere")
                    tokens += delta.token_ids
        return tokens

    try:
        assert asyncio.run(scenario()) == expected
        # Requests go on being served, decoded on the other worker.
        with Client(cluster.router_address, timeout=60) as client:
            done = client.generate(list(range(300, 340)), max_tokens=8, temperature=0,
                                   ignore_eos=True)  # fmt: skip
            assert done.usage.completion_tokens == 8
    finally:
        for w in read_heartbeats(url, cluster.namespace):
            store.delete(keys.duty(w.id))
        store.close()
    poll(lambda: all(not w.duty and not w.switching
                     for w in read_heartbeats(url, cluster.namespace)),
         "every worker back on every duty")  # fmt: skip


def _decoding_worker(cluster: Cluster) -> WorkerInfo:
    url = cluster.redis_url or ""
    found = poll(lambda: [w for w in read_heartbeats(url, cluster.namespace) if w.running_seqs],
                 "a worker to report the running stream")  # fmt: skip
    return found[0]  # type: ignore[no-any-return]


def _heartbeat_of(
    cluster: Cluster, worker_id: str, test: Callable[[WorkerInfo], bool]
) -> WorkerInfo:
    url = cluster.redis_url or ""
    found = poll(lambda: [w for w in read_heartbeats(url, cluster.namespace)
                          if w.id == worker_id and test(w)],
                 f"the heartbeat of {worker_id}")  # fmt: skip
    return found[0]  # type: ignore[no-any-return]


def test_the_router_follows_the_rollout_split_and_rolls_back(cluster: Cluster) -> None:
    url = cluster.metrics_urls()["router"]
    assert cluster.redis_url is not None

    async def set_split(rollout: Rollout) -> None:
        redis = connect(cluster.redis_url or "")
        try:
            await write_rollout(redis, KeySpace(cluster.namespace), rollout)
        finally:
            await redis.aclose()

    def arm_count(arm: str) -> float:
        return metric(url, "pdserve_arm_requests_total", arm=arm, outcome="ok")

    def send(ids: list[str]) -> None:
        with Client(cluster.router_address, timeout=60) as client:
            for rid in ids:
                client.generate([5, 6, 7, 8], max_tokens=2, request_id=rid, ignore_eos=True)

    split = Rollout({"disaggregated": 50.0}, rest="colocated")
    asyncio.run(set_split(split))
    probe = "probe-" + "x" * 8
    # The router applies the split within a moment: poll with a request whose arm is known.
    poll(lambda: (send([probe]), arm_count(split.arm(probe)))[1] > 0, "the router to follow")
    before = {a: arm_count(a) for a in ("disaggregated", "colocated")}
    ids = [f"roll-{i}" for i in range(12)]
    send(ids)
    for arm in ("disaggregated", "colocated"):
        want = sum(split.arm(i) == arm for i in ids)
        assert arm_count(arm) - before[arm] == want, arm
    # Roll back: everything colocated. Poll with a request id the split sent disaggregated.
    asyncio.run(set_split(Rollout({"disaggregated": 0.0}, rest="colocated")))
    moved = next(r for r in (f"rb-{k}" for k in range(200)) if split.arm(r) == "disaggregated")

    def rolled_back() -> bool:
        colocated = arm_count("colocated")
        send([moved])
        return arm_count("colocated") > colocated

    poll(rolled_back, "the roll-back")
    after = arm_count("disaggregated")
    send([f"back-{i}" for i in range(6)])
    assert arm_count("disaggregated") == after
    asyncio.run(_clear_split(cluster))


async def _clear_split(cluster: Cluster) -> None:
    redis = connect(cluster.redis_url or "")
    try:
        await write_rollout(redis, KeySpace(cluster.namespace), None)
    finally:
        await redis.aclose()


# -- the planner against a real Redis (no workers: heartbeats written by the test) ------------


def _mixed(worker_id: str, **kw: Any) -> WorkerInfo:
    fields: dict[str, Any] = {
        "id": worker_id, "role": WorkerRole.MIXED, "address": "127.0.0.1:1", "host": "h",
        "model_fingerprint": "f", "kv_blocks_total": 1000, "kv_blocks_free": 1000,
        "block_size": 16, "max_batch_tokens": 2048, "step_overhead_s": 0.01,
        "decode_seq_s": 0.001, "prefill_token_s": 0.0005,
        "capabilities": ("prefill", "decode", "colocated"),
    }  # fmt: skip
    fields.update(kw)
    return WorkerInfo(**fields)


def test_load_the_scheduler_refuses_moves_workers_its_queues_do_not_show(
    redis_url: str,
) -> None:
    # The scheduler holds prefill queues to 2 batches; the planner's view of the same queue
    # (prefill fast, its default limit of 4 batches) is half full and a short wait: no move.
    # Once the scheduler refuses a prompt for want of prefill room, the planner takes the
    # prefill side as saturated and moves every decode worker it can spare.
    keys = KeySpace(f"shed-{time.monotonic_ns()}")

    async def scenario() -> None:
        redis = connect(redis_url)
        try:
            registry = RedisWorkerRegistry(redis, keys=keys)
            await registry.heartbeat(_mixed("p", serves=("prefill",), duty="prefill",
                                            queued_tokens=4000, prefill_token_s=1e-5),
                                     ttl_s=60)  # fmt: skip
            for name in ("d1", "d2", "d3"):
                await registry.heartbeat(_mixed(name, serves=("decode", "colocated"),
                                                duty="decode"), ttl_s=60)  # fmt: skip
            planner = PlannerLoop(redis, keys, PlannerConfig(cooldown_s=0.0), holder="a",
                                  settle_passes=0)  # fmt: skip
            assert (await planner.run_once()).moves == ()
            scheduler = ClusterScheduler(
                redis, keys=keys, default_mode=Mode.DISAGGREGATED,
                limits=CapacityLimits(prefill_queue_batches=2.0),
            )  # fmt: skip
            with pytest.raises(CapacityError, match="every prefill worker is full"):
                await scheduler.assign("r", 500, 8)
            assert await redis.hgetall(keys.refused) == {b"prefill": b"1"}
            moves = (await planner.run_once()).moves
            assert len(moves) == 2  # min_decode keeps one of the three
            assert all(m.duty == "prefill" and m.reason == "prefill pressure" for m in moves)
            # Counted once: the next pass sees no new refusal, and the view has not changed.
            assert (await planner.run_once()).moves == ()
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_one_planner_leads_and_orders_a_move(redis_url: str) -> None:
    keys = KeySpace(f"planner-{time.monotonic_ns()}")

    async def scenario() -> None:
        redis = connect(redis_url)
        try:
            registry = RedisWorkerRegistry(redis, keys=keys)
            await registry.heartbeat(_mixed("p", serves=("prefill",), duty="prefill",
                                            queued_tokens=7000), ttl_s=60)  # fmt: skip
            for name in ("d1", "d2"):
                await registry.heartbeat(_mixed(name, serves=("decode", "colocated"),
                                                duty="decode"), ttl_s=60)  # fmt: skip
            config = PlannerConfig(cooldown_s=60.0)
            a = PlannerLoop(redis, keys, config, holder="a", settle_passes=2)
            b = PlannerLoop(redis, keys, config, holder="b", settle_passes=0)
            # The view must settle (the same workers twice in a row) before a move.
            assert [(await a.run_once()).moves for _ in range(2)] == [(), ()]
            first = await a.run_once()
            second = await b.run_once()
            assert first.leading and not second.leading
            assert [m.duty for m in first.moves] == ["prefill"]  # d1 or d2: one stays decode
            assert (await redis.get(keys.duty(first.moves[0].worker_id))) == b"prefill"
            assert (await a.run_once()).moves == ()  # cooling down
            await a.lease.release()
            assert (await b.run_once()).leading  # b takes over at once
            assert await LeaderLease(redis, keys, "c").leader() == "b"
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_the_planner_service_moves_a_worker_and_requests_keep_flowing(model_dir: Path) -> None:
    # Both mixed workers start on decode duty; the planner's bounds ask for one prefill worker.
    with Cluster(
        model_dir, mode="conditional", num_prefill=0, num_decode=2, worker_args=WORKER_ARGS,
        duties=("decode", "decode"), planner=True,
        planner_args=("--min-prefill", "1", "--interval-s", "0.2", "--cooldown-s", "1"),
    ) as c:  # fmt: skip
        url = c.redis_url or ""
        planner_metrics = c.metrics_urls()["planner"]
        moved = poll(lambda: [w for w in read_heartbeats(url, c.namespace)
                              if w.duty == "prefill" and not w.switching],
                     "the planner's move to take effect")  # fmt: skip
        assert moved[0].phases == ("prefill",)
        # The other keeps the duty it started with: no order in Redis is no order.
        others = [w for w in read_heartbeats(url, c.namespace) if w.id != moved[0].id]
        assert [(w.duty, w.phases) for w in others] == [("decode", ("decode", "colocated"))]
        assert metric(planner_metrics, "pdserve_planner_leader") == 1
        assert metric(planner_metrics, "pdserve_planner_moves_total", duty="prefill") == 1
        with Client(c.router_address, timeout=60) as client:
            for n in (20, 300):
                done = client.generate(list(range(16, 16 + n)), max_tokens=6, temperature=0,
                                       ignore_eos=True)  # fmt: skip
                assert done.usage.completion_tokens == 6
