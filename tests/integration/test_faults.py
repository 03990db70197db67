"""Faults under load, on a whole cluster (``launcher.Cluster``): the KV store and a prefill
worker killed with SIGKILL in the middle of hand-offs, and corrupted payloads.

Requests whose id starts with ``slow-`` stall after one layer (``--fault stall:1@slow-``) so
that they are certainly mid-transfer when the kill comes; ``bad-`` ones get a byte flipped
after its checksum (``--fault corrupt@bad-``). Every request must either complete with the
tokens of ``Engine.generate`` alone (the decode side recomputes what did not arrive) or end
with a clear error; afterwards no hand-off entry, pending write, shm segment or KV block may
be left anywhere.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.client import KVStoreClient
from pdserve.launcher import Cluster, read_heartbeats
from pdserve.transfer.janitor import (
    SHM_DIR,
    SegmentState,
    holds_hand_off,
    parse_owner_pid,
    segment_state,
)
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.integration.inbox import inbox_held
from tests.integration.test_transfer import hand_off

pytestmark = pytest.mark.integration

MAX_TOKENS = 6
BASE_ARGS = (
    "--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
    "--heartbeat-interval-s", "0.2", "--janitor-interval-s", "0.5",
    "--fault", "stall:1@slow-", "--fault", "corrupt@bad-",
    # Long enough that a stalled hand-off is still waiting when the kill comes.
    "--kv-transfer-timeout-s", "30",
)  # fmt: skip


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2048) for _ in range(rng.randrange(20, 120))] for _ in range(n)]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=256)


def reference(engine: Engine, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return engine.generate([prompt], params)[0].token_ids


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=150))


async def generate(c: Cluster, rid: str, prompt: list[int]) -> list[int]:
    """One request through the router: its tokens (raises the router's error)."""
    async with grpc.aio.insecure_channel(c.router_address) as ch:
        tokens: list[int] = []
        async for chunk in router_pb2_grpc.RouterStub(ch).Generate(
            router_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=prompt),
                request_id=rid,
                sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True
                ),
            ),
            timeout=60,
        ):
            tokens += chunk.token_ids
    return tokens


async def until(probe: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)  # polling other processes: nothing to wait on


async def writing(address: str) -> int:
    async with KVStoreClient(address, timeout_s=5) as client:
        totals = (await client.stat()).totals
    assert totals is not None
    return totals.num_writing


async def arriving(address: str) -> int:
    """Pushes still arriving at a decode worker's inbox."""
    return (await inbox_held(address))[1]


def owner(path: Path) -> int | None:
    return parse_owner_pid(path.name)


async def assert_nothing_left(c: Cluster, *, dead: set[str]) -> None:
    """No hand-off entry or pending write (store, decode workers' inboxes), no shm segment of any
    cluster process (dead ones included: the janitor reclaims those), no busy KV block."""
    pids = {s.proc.pid for s in c.services if s.proc is not None}
    endpoints = [("kvstore", c.kvstore_address)] + [
        (s.name, s.address) for s in c.workers("decode")
    ]

    async def clean() -> bool:
        for name, address in endpoints:
            if name in dead:
                continue
            if name != "kvstore":
                if any(await inbox_held(address)):
                    return False
                continue
            async with KVStoreClient(address, timeout_s=5) as client:
                t = (await client.stat()).totals
            assert t is not None
            if t.num_entries - t.num_cache_entries or t.num_writing:
                return False
        if any(holds_hand_off(p) for p in SHM_DIR.glob("pdserve-kv-*") if owner(p) in pids):
            return False
        for w in read_heartbeats(c.redis_url or "", c.namespace):
            live = any(w.address.endswith(f":{s.port}") for s in c.workers() if s.name not in dead)
            if live and (w.kv_blocks_free != w.kv_blocks_total or w.running_seqs):
                return False
        return True

    await until(clean, "the cluster to hold nothing")


def test_kvstore_killed_mid_transfer(tiny_llama_dir: Path, engine: Engine) -> None:
    """Store hand-offs: stalled ones are mid-stream into the store when it dies, others in
    every other stage. All complete, by recompute where the KV was lost."""
    with Cluster(
        tiny_llama_dir, worker_args=(*BASE_ARGS, "--transport", "store"), log_level="WARNING"
    ) as c:
        batch = prompts(1, 12)

        async def body() -> None:
            slow = [
                asyncio.create_task(generate(c, f"slow-{i}", p)) for i, p in enumerate(batch[:4])
            ]
            await until(lambda: _at_least(writing(c.kvstore_address), 4), "4 stalled puts")
            rest = [
                asyncio.create_task(generate(c, f"{'bad' if i % 2 else 'ok'}-{i}", p))
                for i, p in enumerate(batch[4:])
            ]
            store = next(s for s in c.services if s.name == "kvstore")
            assert store.proc is not None
            store.proc.kill()  # SIGKILL, mid-transfer
            store.proc.wait()
            outs = await asyncio.gather(*slow, *rest)
            for tokens, prompt in zip(outs, batch, strict=True):
                assert tokens == reference(engine, prompt)
            # With the store gone, new hand-offs fail at once and recompute.
            assert await generate(c, "after", batch[0]) == reference(engine, batch[0])
            await assert_nothing_left(c, dead={"kvstore"})

        run(body)


def test_prefill_killed_mid_stream(tiny_llama_dir: Path, engine: Engine) -> None:
    """A prefill worker dies while hand-offs stream straight into the decode worker (direct)
    and into shm segments: those requests fail with UNAVAILABLE; the decode worker drops the
    half-written entries and its janitor unlinks the dead writer's segments. The shm hand-offs
    are announced (``--kv-prefetch-min-bytes 0``): the decode worker is following them when
    the writer dies, and its reads end with the dead writer's Prefetch calls."""
    args = (*BASE_ARGS, "--kv-prefetch-min-bytes", "0")
    with Cluster(tiny_llama_dir, worker_args=args, log_level="WARNING") as c:
        batch = prompts(2, 8)
        decode = c.workers("decode")[0]
        prefill = c.workers("prefill")[0]
        assert prefill.proc is not None
        pid = prefill.proc.pid

        async def segments() -> int:  # being written: a slot between hand-offs is not
            return sum(
                owner(p) == pid and segment_state(p) is SegmentState.WRITING
                for p in SHM_DIR.glob("pdserve-kv-*")
            )

        async def body() -> None:
            # Load that completes before the kill.
            done = await asyncio.gather(
                *(generate(c, f"ok-{i}", p) for i, p in enumerate(batch[:4]))
            )
            assert done == [reference(engine, p) for p in batch[:4]]
            stalled = [
                asyncio.create_task(hand_off(c, f"slow-{t}-{i}", p, t))
                for t in ("direct", "shm")
                for i, p in enumerate(batch[4:])
            ]
            await until(lambda: _at_least(arriving(decode.address), 4), "4 stalled direct streams")
            await until(lambda: _at_least(segments(), 4), "4 stalled shm segments")
            prefill.proc.kill()  # type: ignore[union-attr]
            prefill.proc.wait()  # type: ignore[union-attr]
            outcomes = await asyncio.gather(*stalled, return_exceptions=True)
            for outcome in outcomes:
                assert isinstance(outcome, grpc.aio.AioRpcError), outcome
                assert outcome.code() is grpc.StatusCode.UNAVAILABLE and outcome.details()
            await assert_nothing_left(c, dead={prefill.name})

        run(body)


async def _at_least(count: Awaitable[int], n: int) -> bool:
    return await count >= n
