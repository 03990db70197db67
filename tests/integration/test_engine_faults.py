"""Engine faults on a whole cluster (``--fault nan@bad-``, ``--fault step@boom-`` on every
worker): a request whose logits are NaN fails alone with INTERNAL while the requests beside it
stream the engine's own tokens; a worker whose engine fails step after step turns its health
NOT_SERVING and says ``draining`` in its heartbeat, so that the scheduler places nothing
more there; every process stays up and nothing is left held."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import Cluster, read_heartbeats
from pdserve.service_process import healthy
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.integration.test_e2e import wait_idle

pytestmark = pytest.mark.integration

MAX_TOKENS = 8
WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
               "--heartbeat-interval-s", "0.2",
               "--fault", "nan@bad-", "--fault", "step@boom-")  # fmt: skip
HEALTH_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[Cluster]:
    with Cluster(tiny_llama_dir, worker_args=WORKER_ARGS) as c:
        yield c


def prompt(i: int) -> list[int]:
    return [(37 * i + 11 * j) % 2000 + 3 for j in range(10 + 7 * i)]


async def generate(address: str, rid: str, ids: list[int]) -> list[int]:
    async with grpc.aio.insecure_channel(address) as ch:
        request = router_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=ids),
            request_id=rid,
            sampling=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True
            ),
        )
        return [
            t
            async for chunk in router_pb2_grpc.RouterStub(ch).Generate(request, timeout=60)
            for t in chunk.token_ids
        ]


def test_a_poisoned_request_fails_alone(cluster: Cluster, tiny_llama_dir: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama_dir, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = [r.token_ids for r in engine.generate([prompt(i) for i in range(4)], params)]

    async def body() -> list[list[int] | BaseException]:
        return await asyncio.gather(
            *(generate(cluster.router_address, f"ok-{i}", prompt(i)) for i in range(4)),
            generate(cluster.router_address, "bad-1", prompt(5)),
            return_exceptions=True,
        )

    *good, bad = asyncio.run(body())
    assert good == reference
    assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.INTERNAL
    assert "not finite" in (bad.details() or "")
    assert not cluster.failed()
    assert all(healthy(s.address) for s in cluster.services)
    wait_idle(cluster)


def test_an_engine_that_keeps_failing_stops_taking_work(cluster: Cluster) -> None:
    (prefill,) = cluster.workers("prefill")
    assert cluster.redis_url is not None
    for i in range(3):  # three failed steps in a row, nothing progressing in between
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(generate(cluster.router_address, f"boom-{i}", prompt(1)))
        assert info.value.code() == grpc.StatusCode.INTERNAL
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while healthy(prefill.address) or not any(
        w.draining for w in read_heartbeats(cluster.redis_url, cluster.namespace)
        if w.address == prefill.address
    ):  # fmt: skip
        assert time.monotonic() < deadline, "the failed prefill worker still looks healthy"
        time.sleep(0.05)
    # Nothing is placed there any more: a clean refusal, not a hang or an engine error.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(generate(cluster.router_address, "after", prompt(2)))
    assert refused.value.code() in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ), refused.value
    assert "engine" not in (refused.value.details() or "")
    assert not cluster.failed()  # every process is still up
    assert all(healthy(s.address) for s in cluster.services if s is not prefill)
