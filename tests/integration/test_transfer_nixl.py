"""The nixl transport between worker processes shaped as two hosts on one machine: the prefill
worker bound to 127.0.0.1 ("node-a"), the decode worker to 127.0.0.2 ("node-b"), UCX limited
to TCP (``UCX_TLS=tcp``) so that NIXL's reads cross the loopback network instead of shared
memory. The prefill worker registers its block pool at start and publishes its agent in its
heartbeat; the decode worker finds it there. Greedy tokens through the Prefill and Decode
RPCs must equal ``Engine.generate`` alone's, and every hand-off's blocks must come back. A
hand-off to the decode worker its request's reservation holds is announced as it begins
(``Decode.Prefetch``): the decode worker READs each layer as the prefill marks it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pdserve.compute.omp import worker_omp_env
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import read_heartbeats
from pdserve.redis_server import EmbeddedRedis
from pdserve.scheduling.capacity import Claim, Phase
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.registry import connect
from pdserve.scheduling.reservations import ReservationLedger, ReservationPart
from pdserve.service_process import ServiceProcess, healthy, terminate
from pdserve.transfer.nixl.agent import AgentDescriptor, nixl_available
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pdserve[nixl])"),
]

MAX_TOKENS = 6
POOL_BYTES = 2 * 1024 * 1024
"""The prefill worker's registered pool: a 700-token prompt of the tiny model (2 KiB of KV a
token) fills more than half of it, so a second one fits only once the first one's blocks
came back."""
WORKER_ARGS = (
    "--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
    "--heartbeat-interval-s", "0.2", "--log-level", "WARNING",
    "--nixl-pool-bytes", str(POOL_BYTES), "--nixl-block-bytes", "65536",
)  # fmt: skip


@dataclass
class Nodes:
    redis_url: str
    prefill: str
    decode: str
    agent: AgentDescriptor


def _start(s: ServiceProcess, env: dict[str, str], bind: str, deadline: float) -> str:
    s.spawn(env)
    while not s.read_port():
        s.check_alive()
        if time.monotonic() > deadline:
            pytest.fail(f"{s.name} did not start:\n{s.log_tail()}")
        time.sleep(0.05)  # polling the port file the child writes once serving
    address = f"{bind}:{s.port}"
    while not healthy(address):
        s.check_alive()
        if time.monotonic() > deadline:
            pytest.fail(f"{s.name} is not healthy:\n{s.log_tail()}")
        time.sleep(0.05)
    return address


@pytest.fixture(scope="module")
def nodes(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    logs = tmp_path_factory.mktemp("nixl-nodes")
    deadline = time.monotonic() + 120
    with EmbeddedRedis() as redis:
        env = {
            **worker_omp_env(), "PDSERVE_REDIS_URL": redis.url, "UCX_TLS": "tcp",
            "PYTHONUNBUFFERED": "1",
        }  # fmt: skip

        def service(
            name: str, module: str, args: list[str], role: str | None = None
        ) -> ServiceProcess:
            return ServiceProcess(
                name, module, args, logs / f"{name}.port", logs / f"{name}.log", role=role
            )

        kvstore = service("kvstore", "services.kvstore", ["--log-level", "WARNING"])
        worker = ["--model", str(tiny_llama_dir), *WORKER_ARGS]
        prefill = service(
            "prefill-0", "services.prefill",
            [*worker, "--host", "127.0.0.1", "--host-name", "node-a", "--transport", "nixl",
             "--kvstore", "KVSTORE", "--kv-prefetch-min-bytes", "0",
             # Bounds the wait for a prefetch's answer too: the 1 s floor of a small payload's
             # bound is short on a loaded 2-core host (the Decode call would read it instead).
             "--kv-transfer-timeout-s", "30"],
            role="prefill",
        )  # fmt: skip
        decode = service(
            "decode-0", "services.decode",
            [*worker, "--host", "127.0.0.2", "--host-name", "node-b"], role="decode",
        )  # fmt: skip
        procs = []
        try:
            store = _start(kvstore, env, "127.0.0.1", deadline)
            procs.append(kvstore)
            prefill.args[prefill.args.index("KVSTORE")] = store
            prefill_address = _start(prefill, env, "127.0.0.1", deadline)
            procs.append(prefill)
            decode_address = _start(decode, env, "127.0.0.2", deadline)
            procs.append(decode)
            agent = None
            while agent is None:
                for w in read_heartbeats(redis.url):
                    if w.host == "node-a" and w.kv_agent:
                        agent = AgentDescriptor.decode(w.kv_agent)
                        assert agent.fingerprint == w.kv_agent_fingerprint
                if agent is None and time.monotonic() > deadline:
                    pytest.fail("the prefill worker published no NIXL agent")
                time.sleep(0.05)  # heartbeats every 0.2 s
            yield Nodes(redis.url, prefill_address, decode_address, agent)
        finally:
            terminate([p.proc for p in procs if p.proc is not None], 10)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=256)


def greedy() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


async def reserve_decode(n: Nodes) -> str:
    """A reservation of the decode worker, as the scheduler makes one: a prefill worker
    streams (and announces) KV only to the decode worker its request's reservation holds."""
    decode = next(w for w in read_heartbeats(n.redis_url) if w.host == "node-b")
    redis = connect(n.redis_url)
    try:
        part = ReservationPart(decode.id, Phase.DECODE, Claim(tokens=0, blocks=1))
        committed = await ReservationLedger(redis, KeySpace()).reserve([part], lambda _: None)
    finally:
        await redis.aclose()
    return committed.reservation_id


async def hand_off(
    n: Nodes, rid: str, prompt: list[int], reservation_id: str = ""
) -> tuple[list[int], prefill_pb2.PrefillResponse, common_pb2.Timing]:
    """``reservation_id``: one that holds the decode worker (the hand-off is announced)."""
    async with (
        grpc.aio.insecure_channel(n.prefill) as pch,
        grpc.aio.insecure_channel(n.decode) as dch,
    ):
        route = (
            {"decode_address": n.decode, "decode_host": "node-b", "reservation_id": reservation_id}
            if reservation_id
            else {}
        )
        resp = await prefill_pb2_grpc.PrefillStub(pch).Prefill(
            prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=greedy(), transport="nixl",
                **route,
            ),
            timeout=30,
        )  # fmt: skip
        tokens = [resp.first_token_id]
        timing = common_pb2.Timing()
        async for chunk in decode_pb2_grpc.DecodeStub(dch).Decode(
            decode_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=prompt, first_token_id=resp.first_token_id,
                first_logprob=resp.first_logprob, sampling=greedy(), kv=resp.kv,
            ),
            timeout=30,
        ):  # fmt: skip
            tokens += chunk.token_ids
            if chunk.HasField("timing"):
                timing = chunk.timing
        return tokens, resp, timing


def reference(engine: Engine, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return engine.generate([prompt], params)[0].token_ids


def test_greedy_tokens_over_nixl_equal_the_engine_alone(nodes: Nodes, engine: Engine) -> None:
    rng = random.Random(38)
    batch = [[rng.randrange(2048) for _ in range(n)] for n in (5, 40, 300)]

    async def main() -> None:
        for i, prompt in enumerate(batch):
            tokens, resp, timing = await hand_off(nodes, f"nixl-{i}", prompt)
            assert resp.kv.WhichOneof("location") == "nixl", resp.kv
            assert resp.kv.nixl.agent == nodes.agent.agent
            assert resp.kv.nixl.metadata_fingerprint == nodes.agent.fingerprint
            assert tokens == reference(engine, prompt)
            # The decode worker's record of the read: the bytes the handle names, over nixl.
            assert timing.transfer.transport == "nixl"
            assert timing.transfer.num_bytes == resp.kv.nixl.length > 0
            assert timing.transfer.recv_end_ns > timing.transfer.recv_start_ns
            assert not timing.transfer.prefetched  # no decode worker known: not announced

    asyncio.run(asyncio.wait_for(main(), 120))
    # The link model learns nixl from the decode worker's reads, not from the prefill
    # worker's copies into its blocks (nothing crossed the link then).
    heartbeats = read_heartbeats(nodes.redis_url)
    prefill = next(w for w in heartbeats if w.host == "node-a")
    assert not [link for link in prefill.links if link[1] == "nixl"]


def test_every_hand_off_gives_its_blocks_back(nodes: Nodes, engine: Engine) -> None:
    """A 700-token hand-off takes most of the pool: one after another, each finds room only
    once the previous reader's notification freed the blocks (polled: notifications are
    asynchronous, and a full pool answers recompute)."""
    rng = random.Random(7)
    prompt = [rng.randrange(2048) for _ in range(700)]
    want = reference(engine, prompt)

    async def main() -> None:
        for i in range(3):
            deadline = time.monotonic() + 20
            while True:
                tokens, resp, _ = await hand_off(nodes, f"refill-{i}-{time.monotonic_ns()}", prompt)
                assert tokens == want  # moved or recomputed, the same tokens
                kind = resp.kv.WhichOneof("location")
                if kind == "nixl":
                    break
                assert kind == "recompute" and "blocks asked" in resp.kv.recompute.reason
                if time.monotonic() > deadline:
                    pytest.fail("the pool's blocks did not come back: " + resp.kv.recompute.reason)
                await asyncio.sleep(0.05)  # the previous reader's notification is on its way

    asyncio.run(asyncio.wait_for(main(), 120))


def test_announced_hand_offs_are_read_while_the_prefill_computes(
    nodes: Nodes, engine: Engine
) -> None:
    """Each 700-token hand-off takes most of the pool: the next one fits only once the
    followed read's notification freed the blocks (at the commit)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(2048) for _ in range(700)] for _ in range(2)]

    async def main() -> None:
        reservation = await reserve_decode(nodes)
        for i, prompt in enumerate(prompts):
            deadline = time.monotonic() + 20
            while True:
                rid = f"prefetched-{i}-{time.monotonic_ns()}"
                tokens, resp, timing = await hand_off(nodes, rid, prompt, reservation)
                assert tokens == reference(engine, prompt)
                if resp.kv.WhichOneof("location") == "nixl":
                    break
                assert "blocks asked" in resp.kv.recompute.reason
                if time.monotonic() > deadline:
                    pytest.fail("the pool's blocks did not come back: " + resp.kv.recompute.reason)
                await asyncio.sleep(0.05)  # the previous reader's notification is on its way
            # Read layer by layer as the prefill wrote it, and taken by the Decode call.
            assert timing.transfer.prefetched, (resp.transfer, timing.transfer)
            assert timing.transfer.num_bytes == resp.kv.nixl.length > 0, timing.transfer

    asyncio.run(asyncio.wait_for(main(), 120))
