"""Hand-offs through a Mooncake Store between worker processes on different loopback addresses.

A real ``mooncake_master``; a prefill worker bound to 127.0.0.2 (lending its segment to the
store) and a decode worker bound to 127.0.0.3, with different host names, so nothing may rely
on shared memory or one host: the KV goes prefill -> Mooncake Store -> decode over the
transfer engine's TCP. Driven through the Prefill and Decode RPCs. The greedy tokens must be
those of ``Engine.generate`` alone; a corrupted payload and a master that is gone must each
end in recompute with the same tokens; afterwards the store holds no object. Skipped, with
the reason, where the Mooncake package cannot load.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pdserve import deathsig
from pdserve.compute.omp import worker_omp_env
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.mooncake.library import available
from pdserve.kvstore.mooncake.master import MasterProcess
from pdserve.launcher import Cluster
from pdserve.service_process import healthy, terminate
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

pytestmark = pytest.mark.integration

MAX_TOKENS = 6
WORKER_ARGS = (
    "--dtype", "float32", "--threads", "1", "--kv-blocks", "256", "--log-level", "WARNING",
    "--fault", "corrupt@bad-",
)  # fmt: skip


@dataclass
class Workers:
    master: MasterProcess
    prefill: str
    decode: str
    procs: list[subprocess.Popen[bytes]]


def spawn_worker(
    module: str, host: str, name: str, args: list[str], workdir: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port_file = workdir / f"{name}.port"
    log = (workdir / f"{name}.log").open("ab")
    argv = [sys.executable, "-m", module, "--port", "0", "--port-file", str(port_file),
            "--host", host, "--host-name", name, *args]  # fmt: skip
    proc = subprocess.Popen(
        deathsig.wrap(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=worker_omp_env(),
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            terminate([proc], 5)
            text = (workdir / f"{name}.log").read_text(errors="replace")[-3000:]
            pytest.fail(f"{name} did not start:\n{text}")
        time.sleep(0.05)  # polling a child process's port file; nothing to wait on
    address = f"{host}:{int(port_file.read_text())}"
    while not healthy(address):
        if time.monotonic() > deadline:
            pytest.fail(f"{name} at {address} never became healthy")
        time.sleep(0.05)
    return proc, address


@pytest.fixture(scope="module")
def workers(tiny_llama_dir: Path) -> Iterator[Workers]:
    reason = available()
    if reason:
        pytest.skip(reason)
    with tempfile.TemporaryDirectory(prefix="pdserve-mc-") as tmp, MasterProcess() as master:
        workdir = Path(tmp)
        store = ["--kvstore", master.address(segment="64MiB")]
        common = ["--model", str(tiny_llama_dir), *WORKER_ARGS]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            p, prefill = spawn_worker(
                "services.prefill", "127.0.0.2", "host-p", [*common, *store], workdir
            )
            procs.append(p)
            d, decode = spawn_worker("services.decode", "127.0.0.3", "host-d", common, workdir)
            procs.append(d)
            yield Workers(master, prefill, decode, procs)
        finally:
            terminate(procs, 10)


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
    w: Workers, rid: str, prompt: list[int]
) -> tuple[list[int], prefill_pb2.PrefillResponse, common_pb2.Timing]:
    async with (
        grpc.aio.insecure_channel(w.prefill) as pch,
        grpc.aio.insecure_channel(w.decode) as dch,
    ):
        resp: prefill_pb2.PrefillResponse = await prefill_pb2_grpc.PrefillStub(pch).Prefill(
            prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=greedy(),
                decode_address=w.decode, decode_host="host-d", transport="store",
            ),
            timeout=60,
        )  # fmt: skip
        tokens = [resp.first_token_id]
        timing = common_pb2.Timing()
        async for chunk in decode_pb2_grpc.DecodeStub(dch).Decode(
            decode_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=prompt, first_token_id=resp.first_token_id,
                first_logprob=resp.first_logprob, sampling=greedy(), kv=resp.kv,
            ),
            timeout=60,
        ):  # fmt: skip
            tokens += chunk.token_ids
            if chunk.HasField("timing"):
                timing = chunk.timing
    return tokens, resp, timing


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2048) for _ in range(n)] for n in lengths]


def test_hand_offs_through_the_store_match_the_engine_alone(
    workers: Workers, engine: Engine
) -> None:
    batch = prompts(1, [5, 40, 130])

    async def body() -> None:
        outs = await asyncio.gather(*(hand_off(workers, f"mc-{i}", p) for i, p in enumerate(batch)))
        for (tokens, resp, timing), prompt in zip(outs, batch, strict=True):
            assert tokens == reference(engine, prompt)
            assert resp.kv.WhichOneof("location") == "store"
            assert resp.kv.store.address.startswith(f"mooncake://{workers.master.master}")
            assert timing.transport == "store" and timing.transfer.transport == "store"
            assert resp.transfer_bytes == timing.transfer_bytes > 0
            assert timing.transfer.recv_end_ns > timing.transfer.recv_start_ns > 0
            assert not timing.transfer.prefetched  # objects appear whole: read at Decode

    run(body)
    assert workers.master.key_count() == 0  # each read deleted its object


def test_a_corrupted_payload_is_recomputed_with_the_same_tokens(
    workers: Workers, engine: Engine
) -> None:
    prompt = prompts(2, [60])[0]

    async def body() -> None:
        tokens, resp, timing = await hand_off(workers, "bad-mc-0", prompt)
        assert resp.kv.WhichOneof("location") == "store"  # the store took it; the check did not
        assert timing.transport == "recompute"
        assert tokens == reference(engine, prompt)

    run(body)
    assert workers.master.key_count() == 0  # the failed read deleted it too


def test_with_the_master_gone_the_hand_off_is_recomputed(workers: Workers, engine: Engine) -> None:
    """Last in the module: it stops the master."""
    prompt = prompts(3, [50])[0]
    workers.master.kill()

    async def body() -> None:
        tokens, resp, timing = await hand_off(workers, "mc-down-0", prompt)
        assert resp.kv.WhichOneof("location") == "recompute"
        assert resp.kv.recompute.reason
        assert timing.transport == "recompute"
        assert tokens == reference(engine, prompt)

    run(body)


def test_a_cluster_with_a_mooncake_store_serves_through_the_router(
    tiny_llama_dir: Path, engine: Engine
) -> None:
    """``Cluster(kv_store="mooncake")`` (what ``pdserve up --kv-store mooncake`` runs): the
    cluster starts the master instead of the KV store service, its workers join it, and a
    routed request's hand-off goes through it."""
    reason = available()
    if reason:
        pytest.skip(reason)
    prompt = prompts(4, [70])[0]
    args = [*WORKER_ARGS, "--transport", "store"]
    with Cluster(
        tiny_llama_dir, num_prefill=1, num_decode=1, mode="disaggregated", worker_args=args,
        kv_store="mooncake", mooncake_segment="64MiB", log_level="WARNING",
    ) as c:  # fmt: skip
        master = c.mooncake_master
        assert master is not None and c.kvstore_address.startswith("mooncake://")
        assert not any(s.name == "kvstore" for s in c.services)

        async def body() -> common_pb2.Timing:
            async with grpc.aio.insecure_channel(c.router_address) as ch:
                tokens: list[int] = []
                timing = common_pb2.Timing()
                async for chunk in router_pb2_grpc.RouterStub(ch).Generate(
                    router_pb2.GenerateRequest(
                        token_ids=common_pb2.TokenIds(ids=prompt), sampling=greedy()
                    ),
                    timeout=60,
                ):
                    tokens += chunk.token_ids
                    if chunk.HasField("timing"):
                        timing = chunk.timing
            assert tokens == reference(engine, prompt)
            return timing

        timing = asyncio.run(asyncio.wait_for(body(), timeout=120))
        assert timing.transport == "store" and timing.transfer_bytes > 0
        assert master.key_count() == 0


def test_the_schedulers_index_learns_the_prefixes_the_store_holds(
    tiny_llama_dir: Path, engine: Engine
) -> None:
    """Two prefill workers sharing prefix chunks through a Mooncake Store: once one computed a
    prompt, the prefix index (the scheduler's, following the cluster's KV event stream here)
    knows the store holds its chunks, so the other worker, which never saw the prompt, may
    reuse them, and does; chunks evicted from the store are put back by the next prefill that
    misses them, and the index holds them again (the miss itself: tests/unit/prefix)."""
    from redis.asyncio import Redis

    from pdserve.kvstore.mooncake.client import MooncakeStoreClient
    from pdserve.launcher import read_heartbeats
    from pdserve.prefix.store import PrefixReuse
    from pdserve.scheduling.keys import KeySpace
    from pdserve.scheduling.prefix_index import PrefixIndex, PromptBlocks, following
    from tests.integration.test_transfer import hand_off as routed_hand_off

    reason = available()
    if reason:
        pytest.skip(reason)
    chunk = 32
    prompt = prompts(5, [3 * chunk + 5])[0]
    args = [*WORKER_ARGS, "--prefix-reuse", "--prefix-chunk-tokens", str(chunk),
            "--heartbeat-interval-s", "0.2"]  # fmt: skip
    with Cluster(
        tiny_llama_dir, num_prefill=2, num_decode=1, mode="disaggregated", worker_args=args,
        kv_store="mooncake", mooncake_segment="64MiB", log_level="WARNING",
    ) as c:  # fmt: skip
        store = c.kvstore_address
        infos = {w.id: w for w in read_heartbeats(c.redis_url or "", c.namespace)}
        prefills = sorted(i for i, w in infos.items() if w.role.value == "prefill")
        assert {infos[i].prefix_store for i in prefills} == {store}
        other = next(i for i in prefills if infos[i].address == c.workers("prefill")[1].address)
        blocks = PromptBlocks(prompt, "a")

        async def until(what: str, done: Callable[[], bool]) -> None:
            deadline = time.monotonic() + 20
            while not done():  # the events arrive after the prefill answered
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.05)

        async def body() -> None:
            index = PrefixIndex()
            redis = Redis.from_url(c.redis_url or "")
            try:
                async with following(index, redis, KeySpace(c.namespace)):
                    tokens, resp, _ = await routed_hand_off(c, "pi-0", prompt, "store", tenant="a")
                    assert resp.num_cached_tokens == 0
                    await until(
                        "the store's chunks never reached the index",
                        lambda: blocks.reusable_tokens(index, other, store) == 3 * chunk,
                    )
                    assert blocks.cached_tokens(index, other) == 0  # not in its own cache
                    again, resp, _ = await routed_hand_off(
                        c, "pi-1", prompt, "store", prefill=1, tenant="a"
                    )
                    assert resp.num_cached_tokens == 3 * chunk  # fetched from the store
                    assert again == tokens == reference(engine, prompt)
                    # Mooncake evicts: the chunks go; the next prefill misses them, computes
                    # and puts them back, and the index holds them again.
                    reuse = PrefixReuse(None, engine.layout, chunk_tokens=chunk)  # type: ignore[arg-type]
                    keys = reuse.keys(prompt, "a")
                    async with MooncakeStoreClient(store, timeout_s=5) as client:
                        for key in keys:
                            assert await client.delete(key)
                        assert await client.lookup(keys) == 0
                        await routed_hand_off(c, "pi-2", prompt, "store", prefill=1, tenant="a")
                        deadline = time.monotonic() + 20
                        while await client.lookup(keys) < len(keys):
                            assert time.monotonic() < deadline, "the chunks were not put back"
                            await asyncio.sleep(0.05)  # publishing runs after the answer
                    await until(
                        "the index lost the chunks put back",
                        lambda: blocks.reusable_tokens(index, other, store) == 3 * chunk,
                    )
            finally:
                await redis.aclose()

        asyncio.run(asyncio.wait_for(body(), timeout=120))


def test_pdserve_up_with_a_mooncake_store(
    tiny_llama_dir: Path, engine: Engine, tmp_path: Path
) -> None:
    """``pdserve up --kv-store mooncake`` as a person runs it: no KV store service among the
    services it names, and a request handed off through the store gives the engine's tokens."""
    from pdserve.client import Client
    from tests.integration.up_process import pdserve_up

    reason = available()
    if reason:
        pytest.skip(reason)
    args = ["--port", "0", "--no-http", "--mode", "disaggregated", "--kv-store", "mooncake",
            "--mooncake-segment", "64MiB", "--worker-arg=--dtype=float32",
            "--worker-arg=--threads=1", "--worker-arg=--kv-blocks=256",
            "--worker-arg=--transport=store"]  # fmt: skip
    prompt = prompts(6, [40])[0]
    with pdserve_up(tiny_llama_dir, args, tmp_path) as up:
        assert "kvstore" not in up.metrics and "prefill-0" in up.metrics, "\n".join(up.banner)
        with Client(up.router, timeout=60) as client:
            done = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    assert list(done.token_ids) == reference(engine, prompt)
