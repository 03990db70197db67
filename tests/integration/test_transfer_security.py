"""Who a hand-off's KV can reach (``launcher.Cluster``, plaintext, driven through the Prefill
and Decode RPCs):

* a prefill worker sends KV (and any connection: the prefix lookup, a ``direct`` stream, an
  announcement) only to the decode worker its request's reservation holds; any other address
  (no reservation, a forged one, another worker's) gets nothing, and the KV goes through the
  store, so the request still completes with the engine's tokens;
* a handle whose capability was guessed reads nothing: a store key with another capability
  does not exist (the decode worker recomputes the caller's own prompt), an shm segment
  refuses it (PERMISSION_DENIED), and the victim's hand-off, prefetched or not, stays whole
  for the victim.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.engine.engine import Engine
from pdserve.kvstore.client import KVStoreClient
from pdserve.kvstore.store import KVStore
from pdserve.kvstore.wire import add_kvstore_servicer
from pdserve.launcher import Cluster
from pdserve.rpc.server import build_server
from pdserve.transfer.janitor import SHM_DIR
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.kvstore.servicer import KVStoreServicer
from tests.integration.test_transfer import HOST, greedy, prompts, reference

pytestmark = pytest.mark.integration

WORKER_ARGS = (
    "--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
    "--heartbeat-interval-s", "0.2", "--kv-prefetch-min-bytes", "0",
)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[Cluster]:
    with Cluster(tiny_llama_dir, worker_args=WORKER_ARGS, log_level="WARNING") as c:
        yield c


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=256)


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=120))


class _Calls(grpc.aio.ServerInterceptor):
    """Counts every call a server receives."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.methods.append(details.method)
        return await continuation(details)


async def assign(cluster: Cluster, rid: str, prompt: list[int]) -> scheduler_pb2.Assignment:
    async with grpc.aio.insecure_channel(cluster.scheduler_address) as ch:
        return await scheduler_pb2_grpc.SchedulerStub(ch).Assign(
            scheduler_pb2.AssignRequest(request_id=rid, prompt_tokens=len(prompt), max_tokens=6),
            timeout=30,
        )


async def prefill(
    cluster: Cluster, rid: str, prompt: list[int], **fields: Any
) -> prefill_pb2.PrefillResponse:
    async with grpc.aio.insecure_channel(cluster.workers("prefill")[0].address) as ch:
        resp: prefill_pb2.PrefillResponse = await prefill_pb2_grpc.PrefillStub(ch).Prefill(
            prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=greedy(), **fields
            ),
            timeout=30,
        )
    return resp


async def decode(
    cluster: Cluster, rid: str, prompt: list[int], first: prefill_pb2.PrefillResponse,
    kv: common_pb2.KVHandle,
) -> tuple[list[int], common_pb2.Timing]:  # fmt: skip
    tokens, timing = [first.first_token_id], common_pb2.Timing()
    async with grpc.aio.insecure_channel(cluster.workers("decode")[0].address) as ch:
        async for chunk in decode_pb2_grpc.DecodeStub(ch).Decode(
            decode_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=prompt, first_token_id=first.first_token_id,
                first_logprob=first.first_logprob, sampling=greedy(), kv=kv,
            ),
            timeout=30,
        ):  # fmt: skip
            tokens += chunk.token_ids
            if chunk.HasField("timing"):
                timing = chunk.timing
    return tokens, timing


def test_prefill_sends_kv_only_to_the_reserved_decode_worker(
    cluster: Cluster, engine: Engine
) -> None:
    batch = prompts(21, [30, 30, 30, 30])
    decode_address = cluster.workers("decode")[0].address

    async def body() -> None:
        calls = _Calls()
        rogue_store = KVStore(64 << 20)
        server, port, _ = build_server(
            [(add_kvstore_servicer, KVStoreServicer(rogue_store))], port=0, interceptors=[calls]
        )
        await server.start()
        rogue = f"127.0.0.1:{port}"
        try:
            reserved = await assign(cluster, "legit", batch[0])
            attempts = {
                "no reservation": {},
                "forged reservation": {"reservation_id": "0" * 32},
                "another worker's reservation": {"reservation_id": reserved.reservation_id},
            }
            for i, (what, fields) in enumerate(attempts.items(), start=1):
                rid, prompt = f"push-{i}", batch[i]
                resp = await prefill(
                    cluster, rid, prompt, decode_address=rogue, decode_host="elsewhere",
                    transport="direct", **fields,
                )  # fmt: skip
                # Not the rogue endpoint: the KV went through the store.
                assert resp.kv.WhichOneof("location") == "store", what
                tokens, timing = await decode(cluster, rid, prompt, resp, resp.kv)
                assert tokens == reference(engine, prompt) and timing.transport == "store"
            assert calls.methods == [] and rogue_store.stats().bytes_in == 0
            # The reserved decode worker is pushed to as asked.
            resp = await prefill(
                cluster, "legit", batch[0], decode_address=decode_address, decode_host=HOST,
                transport="direct", reservation_id=reserved.reservation_id,
            )  # fmt: skip
            assert resp.kv.WhichOneof("location") == "direct"
            assert resp.kv.direct.address == decode_address
            tokens, _ = await decode(cluster, "legit", batch[0], resp, resp.kv)
            assert tokens == reference(engine, batch[0])
        finally:
            await server.stop(None)
            rogue_store.close()

    run(body)


def guessed(kv: common_pb2.KVHandle) -> common_pb2.KVHandle:
    """``kv`` with a capability of the attacker's own (everything else copied)."""
    forged = common_pb2.KVHandle()
    forged.CopyFrom(kv)
    forged.capability = secrets.token_bytes(16)
    if kv.WhichOneof("location") == "store":
        forged.store.key = kv.store.key.rsplit("/", 1)[0] + "/" + forged.capability.hex()
    return forged


def test_a_guessed_store_handle_finds_nothing(cluster: Cluster, engine: Engine) -> None:
    victim, attacker = prompts(22, [40, 40])

    async def body() -> None:
        reserved = await assign(cluster, "v-store", victim)
        resp = await prefill(
            cluster, "v-store", victim, transport="store", reservation_id=reserved.reservation_id
        )
        assert resp.kv.WhichOneof("location") == "store"
        # Same request id, same store, same length: only the capability is the attacker's.
        _, timing = await decode(cluster, "v-store", attacker, resp, guessed(resp.kv))
        # Nothing under that key: the decode worker prefilled the attacker's own prompt.
        assert timing.transfer.transport == "recompute"
        assert timing.transfer.fallback_reason.startswith("store receive failed")
        async with KVStoreClient(cluster.kvstore_address, timeout_s=5) as store:
            assert (await store.stat(resp.kv.store.key)).exists  # still the victim's
        tokens, timing = await decode(cluster, "v-store", victim, resp, resp.kv)
        assert tokens == reference(engine, victim) and timing.transport == "store"

    run(body)


def test_a_guessed_shm_handle_is_refused_and_the_victim_keeps_its_kv(
    cluster: Cluster, engine: Engine
) -> None:
    victim = prompts(23, [40])[0]

    async def body() -> None:
        reserved = await assign(cluster, "v-shm", victim)
        resp = await prefill(
            cluster, "v-shm", victim, transport="shm", reservation_id=reserved.reservation_id,
            decode_address=reserved.decode.address, decode_host=HOST,
        )  # fmt: skip
        assert resp.kv.WhichOneof("location") == "shm"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decode(cluster, "v-shm", victim, resp, guessed(resp.kv))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "capability" in (err.value.details() or "")
        assert (SHM_DIR / resp.kv.shm.name).exists()
        tokens, timing = await decode(cluster, "v-shm", victim, resp, resp.kv)
        assert tokens == reference(engine, victim)
        # Announced as it began (every hand-off is, here): the victim takes its prefetch.
        assert timing.transport == "shm" and timing.transfer.prefetched

    run(body)
