"""KV hand-offs between worker processes (``launcher.Cluster``: KV store, 2 prefill workers,
1 decode worker, scheduler, router), driven through the Prefill and Decode RPCs directly so
that each transport can be asked for, and once through the router.

For every transport the greedy tokens must be those of ``Engine.generate`` alone; a corrupted
payload must end in recompute with the same tokens; prefix chunks must be shared between the
prefill workers through the store, and never between tenants; a prompt whose prefix the decode
worker caches moves only the rest (same tenant only); afterwards no hand-off entry
(store or decode endpoint), shm segment or KV block may be left.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.client import KVStoreClient
from pdserve.launcher import Cluster, read_heartbeats
from pdserve.transfer.janitor import SHM_DIR, holds_hand_off, parse_owner_pid
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.integration.inbox import inbox_held

pytestmark = pytest.mark.integration

HOST = socket.gethostname()
MAX_TOKENS = 6
CHUNK = 32
"""--prefix-chunk-tokens of the cluster: prompts of a few chunks are cheap."""
WORKER_ARGS = (
    "--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
    "--heartbeat-interval-s", "0.2", "--janitor-interval-s", "0.5",
    "--prefix-reuse", "--prefix-chunk-tokens", str(CHUNK), "--fault", "corrupt@bad-",
    "--kv-prefetch-min-bytes", "0",  # the test model's payloads are small: prefetch them all
)  # fmt: skip


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2048) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[Cluster]:
    with Cluster(
        tiny_llama_dir, num_prefill=2, num_decode=1, worker_args=WORKER_ARGS, log_level="WARNING"
    ) as c:
        yield c


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=256)


def reference(engine: Engine, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return engine.generate([prompt], params)[0].token_ids


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=120))


def greedy() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


async def hand_off(
    c: Cluster,
    rid: str,
    prompt: list[int],
    transport: str,
    *,
    prefill: int = 0,
    tenant: str = "",
    before_decode: Callable[[prefill_pb2.PrefillResponse], None] | None = None,
) -> tuple[list[int], prefill_pb2.PrefillResponse, common_pb2.Timing]:
    """Prefill on prefill-``prefill``, decode on decode-0: the tokens and both timings.

    The scheduler reserves the decode worker first, as for a routed request: a prefill worker
    sends KV only to the decode worker its request's reservation holds."""
    decode = c.workers("decode")[0]
    async with (
        grpc.aio.insecure_channel(c.workers("prefill")[prefill].address) as pch,
        grpc.aio.insecure_channel(decode.address) as dch,
        grpc.aio.insecure_channel(c.scheduler_address) as sch,
    ):
        scheduler = scheduler_pb2_grpc.SchedulerStub(sch)
        assigned = await scheduler.Assign(
            scheduler_pb2.AssignRequest(
                request_id=rid, prompt_tokens=len(prompt), max_tokens=MAX_TOKENS, tenant=tenant
            ),
            timeout=30,
        )
        assert assigned.decode.address == decode.address
        try:
            return await _prefill_decode(
                pch, dch, rid, prompt, transport, tenant, assigned, before_decode
            )
        finally:
            await scheduler.Release(
                scheduler_pb2.ReleaseRequest(reservation_id=assigned.reservation_id), timeout=30
            )


async def _prefill_decode(
    pch: grpc.aio.Channel,
    dch: grpc.aio.Channel,
    rid: str,
    prompt: list[int],
    transport: str,
    tenant: str,
    assigned: scheduler_pb2.Assignment,
    before_decode: Callable[[prefill_pb2.PrefillResponse], None] | None,
) -> tuple[list[int], prefill_pb2.PrefillResponse, common_pb2.Timing]:
    resp: prefill_pb2.PrefillResponse = await prefill_pb2_grpc.PrefillStub(pch).Prefill(
        prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=greedy(), tenant=tenant,
            decode_address=assigned.decode.address, decode_host=HOST, transport=transport,
            reservation_id=assigned.reservation_id,
        ),
        timeout=30,
    )  # fmt: skip
    if before_decode is not None:
        before_decode(resp)
    tokens = [resp.first_token_id]
    timing = common_pb2.Timing()
    async for chunk in decode_pb2_grpc.DecodeStub(dch).Decode(
        decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, first_token_id=resp.first_token_id,
            first_logprob=resp.first_logprob, sampling=greedy(), kv=resp.kv, tenant=tenant,
            reservation_id=assigned.reservation_id,
        ),
        timeout=30,
    ):  # fmt: skip
        tokens += chunk.token_ids
        if chunk.HasField("timing"):
            timing = chunk.timing
    return tokens, resp, timing


async def assert_nothing_left(c: Cluster) -> None:
    """No hand-off entry or pending write (KV store, decode workers' inboxes), segment of a
    cluster process, or busy KV block."""
    pids = {s.proc.pid for s in c.services if s.proc is not None}
    deadline = time.monotonic() + 20
    while True:
        problems = []
        async with KVStoreClient(c.kvstore_address, timeout_s=5) as client:
            t = (await client.stat()).totals
        assert t is not None
        if t.num_entries - t.num_cache_entries or t.num_writing:
            problems.append(f"kvstore: {t.num_entries} entries, {t.num_writing} writing")
        for s in c.workers("decode"):
            held, arriving = await inbox_held(s.address)
            if held or arriving:
                problems.append(f"{s.name}: inbox holds {held}, {arriving} arriving")
        segments = [
            p.name
            for p in SHM_DIR.glob("pdserve-kv-*")
            if parse_owner_pid(p.name) in pids and holds_hand_off(p)
        ]
        if segments:
            problems.append(f"shm segments {segments}")
        for w in read_heartbeats(c.redis_url or "", c.namespace):
            if w.kv_blocks_free != w.kv_blocks_total or w.running_seqs:
                problems.append(f"{w.id}: {w.kv_blocks_free}/{w.kv_blocks_total} blocks free")
        if not problems:
            return
        if time.monotonic() > deadline:
            pytest.fail("left behind: " + "; ".join(problems))
        await asyncio.sleep(0.1)  # polling heartbeats written every 0.2 s


@pytest.mark.parametrize("transport", ["store", "direct", "shm", "recompute", ""])
def test_each_transport_matches_the_engine_alone(
    cluster: Cluster, engine: Engine, transport: str
) -> None:
    """ "" lets the prefill worker choose: the decode worker is on its host, so shm."""
    batch = prompts(len(transport), [5, 40, 100])

    async def body() -> None:
        outs = await asyncio.gather(
            *(
                hand_off(cluster, f"t-{transport or 'auto'}-{i}", p, transport)
                for i, p in enumerate(batch)
            )
        )
        expected = transport or "shm"
        for (tokens, resp, timing), prompt in zip(outs, batch, strict=True):
            assert tokens == reference(engine, prompt)
            assert resp.kv.WhichOneof("location") == expected
            assert resp.transfer.transport == timing.transfer.transport == expected
            assert timing.transport == expected
            if expected != "recompute":
                assert resp.transfer_bytes == timing.transfer_bytes > 0
                assert resp.transfer.send_end_ns >= resp.transfer.compute_end_ns > 0
                assert timing.transfer.recv_end_ns > timing.transfer.recv_start_ns > 0
                assert resp.transfer.bytes_per_s > 0 and timing.transfer.bytes_per_s > 0
                # Layer-wise store/shm hand-offs are announced as they begin: the decode
                # worker read them while the prefill computed (direct streams in anyway).
                assert timing.transfer.prefetched == (expected in ("store", "shm"))
        await assert_nothing_left(cluster)

    run(body)


@pytest.mark.parametrize("transport", ["store", "direct", "shm"])
def test_a_corrupted_payload_is_recomputed(
    cluster: Cluster, engine: Engine, transport: str
) -> None:
    """The prefill worker flips a byte after the checksum was taken (``--fault corrupt@bad-``):
    store/direct in the first frame, shm in layer 0 of the segment."""
    prompt = prompts(7, [60])[0]

    async def body() -> None:
        tokens, resp, timing = await hand_off(cluster, f"bad-{transport}", prompt, transport)
        assert tokens == reference(engine, prompt)
        assert timing.transfer.transport == "recompute"
        assert "checksum" in timing.transfer.fallback_reason.lower()
        if transport == "direct":
            # The decode worker's endpoint checks frames as they land and refuses the Put, so
            # the prefill worker already answers recompute.
            assert resp.kv.WhichOneof("location") == "recompute"
            assert "checksum" in resp.transfer.fallback_reason.lower()
        else:  # the store and the segment keep what they got; the reader notices
            assert resp.kv.WhichOneof("location") == transport
        await assert_nothing_left(cluster)

    run(body)


def test_prefix_chunks_are_shared_by_prefill_workers_not_tenants(
    cluster: Cluster, engine: Engine
) -> None:
    prompt = prompts(11, [3 * CHUNK + 5])[0]  # three whole chunks, then a tail

    async def cache_entries() -> int:
        async with KVStoreClient(cluster.kvstore_address, timeout_s=5) as client:
            totals = (await client.stat()).totals
        assert totals is not None
        return totals.num_cache_entries

    async def published(n: int) -> None:
        deadline = time.monotonic() + 20
        while await cache_entries() < n:  # publishing runs after the prefill answered
            assert time.monotonic() < deadline, "prefix chunks never reached the store"
            await asyncio.sleep(0.05)

    async def body() -> None:
        before = await cache_entries()
        tokens, resp, _ = await hand_off(cluster, "pfx-a0", prompt, "shm", prefill=0, tenant="a")
        assert resp.num_cached_tokens == 0
        await published(before + 3)
        # The other prefill worker has never seen the prompt: it fetches the three chunks.
        again, resp, _ = await hand_off(cluster, "pfx-a1", prompt, "shm", prefill=1, tenant="a")
        assert resp.num_cached_tokens == 3 * CHUNK
        assert again == tokens == reference(engine, prompt)
        # Another tenant shares nothing: not the store's chunks, not the engine's blocks.
        other, resp, _ = await hand_off(cluster, "pfx-b1", prompt, "shm", prefill=1, tenant="b")
        assert resp.num_cached_tokens == 0 and other == tokens
        await published(before + 6)
        assert await cache_entries() == before + 6
        await assert_nothing_left(cluster)

    run(body)


@pytest.mark.parametrize("transport", ["store", "direct", "shm"])
def test_only_the_blocks_the_decode_worker_lacks_are_sent(
    cluster: Cluster, engine: Engine, transport: str
) -> None:
    """The decode worker decoded ``first`` before; a prompt extending it moves only the KV
    after the whole blocks they share, for the same tenant and not for another."""
    first, tail = prompts(17 + len(transport), [70, 25])
    longer = first + tail
    bs = engine.config.block_size
    shared = len(first) // bs * bs  # whole blocks of ``first`` alone (then generated tokens)

    async def body() -> None:
        tokens, resp, _ = await hand_off(cluster, f"dp-{transport}-0", first, transport, tenant="a")
        assert tokens == reference(engine, first) and resp.kv.prefix_tokens == 0
        tokens, resp, timing = await hand_off(
            cluster, f"dp-{transport}-1", longer, transport, tenant="a"
        )
        assert tokens == reference(engine, longer)
        assert timing.transfer.transport == transport  # received, not recomputed
        assert resp.kv.prefix_tokens == shared > 0
        assert resp.kv.num_tokens == len(longer) - shared
        partial = resp.transfer_bytes
        # Another tenant gets nothing of tenant a's cache: the whole prompt moves.
        tokens, resp, timing = await hand_off(
            cluster, f"dp-{transport}-2", longer, transport, tenant="b"
        )
        assert tokens == reference(engine, longer) and timing.transfer.transport == transport
        assert resp.kv.prefix_tokens == 0 and resp.kv.num_tokens == len(longer)
        assert 0 < partial < resp.transfer_bytes
        await assert_nothing_left(cluster)

    run(body)


def test_through_the_router(cluster: Cluster, engine: Engine) -> None:
    prompt = prompts(13, [50])[0]

    async def body() -> None:
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            tokens: list[int] = []
            timing = common_pb2.Timing()
            async for chunk in stub.Generate(
                router_pb2.GenerateRequest(
                    token_ids=common_pb2.TokenIds(ids=prompt), sampling=greedy()
                ),
                timeout=60,
            ):
                tokens += chunk.token_ids
                if chunk.HasField("timing"):
                    timing = chunk.timing
        assert tokens == reference(engine, prompt)
        assert timing.transport in ("shm", "store")  # shm once the router names the decoder
        assert timing.transfer_bytes > 0
        await assert_nothing_left(cluster)

    run(body)
