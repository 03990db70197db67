"""Request ids are scoped by tenant (docs/security.md, "Request ids"), on a cluster with API
keys (each key names its tenant) and one prefill and one decode worker, so that every request
meets the others on the same engines, shm segments and KV keys:

* another tenant sending the id of a request in flight gets its own answer, and the first
  request streams on undisturbed: both exact, token for token;
* the same tenant sending an id it has in flight is refused (ALREADY_EXISTS), the first
  request streams on undisturbed, and the id is free again once that request has ended;
* nothing is left behind (KV blocks, reservations, KV store entries).
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.client import AsyncClient, Completion, ServerError
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import Cluster
from tests.integration.test_e2e import wait_idle

pytestmark = pytest.mark.integration

WORKER_ARGS = (
    "--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
    "--heartbeat-interval-s", "0.2",
)  # fmt: skip
KEYS = {tenant: f"k-{tenant}-{secrets.token_hex(12)}" for tenant in ("acme", "globex")}
LONG = 500
"""Tokens of the request held in flight: hundreds of decode steps after its first token, while
the other request needs a prefill and a few steps."""
SHORT = 8


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    keys_file = tmp_path_factory.mktemp("tenant_ids") / "keys.yaml"
    keys_file.write_text("keys:\n" + "".join(f'  "{k}": {t}\n' for t, k in KEYS.items()))
    with Cluster(
        tiny_llama_dir, worker_args=WORKER_ARGS, log_level="WARNING", api_keys=keys_file
    ) as c:
        yield c


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=256)


def prompt(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(n)]


def expected(engine: Engine, ids: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return engine.generate([ids], params)[0].token_ids


def client(cluster: Cluster, tenant: str) -> AsyncClient:
    return AsyncClient(cluster.router_address, api_key=KEYS[tenant], timeout=120)


async def around_first_token(
    cluster: Cluster, ids: list[int], request_id: str, other: Callable[[], Awaitable[None]]
) -> tuple[list[int], str | None]:
    """acme streams its long request ``request_id``; once its first token is here (the request
    is in flight on the workers) ``other`` runs to its end, then the rest is read. The tokens
    and the finish reason."""
    tokens: list[int] = []
    finish: str | None = None
    async with (
        client(cluster, "acme") as acme,
        acme.stream(
            ids, max_tokens=LONG, temperature=0, ignore_eos=True, request_id=request_id
        ) as stream,
    ):
        async for delta in stream:
            first = not tokens
            tokens += delta.token_ids
            finish = delta.finish_reason
            if first:
                assert delta.request_id == request_id and not delta.finished
                await other()
    return tokens, finish


async def short_request(
    cluster: Cluster, tenant: str, ids: list[int], request_id: str
) -> Completion:
    async with client(cluster, tenant) as c:
        return await c.generate(
            ids, max_tokens=SHORT, temperature=0, ignore_eos=True, request_id=request_id
        )


def test_another_tenant_reusing_an_id_in_flight_disturbs_nothing(
    cluster: Cluster, engine: Engine
) -> None:
    long_ids, short_ids = prompt(1), prompt(2)
    answers: list[Completion] = []

    async def globex_same_id() -> None:
        answers.append(await short_request(cluster, "globex", short_ids, "shared"))

    tokens, finish = asyncio.run(around_first_token(cluster, long_ids, "shared", globex_same_id))
    assert tokens == expected(engine, long_ids, LONG) and finish == "length"
    (answer,) = answers
    assert answer.token_ids == expected(engine, short_ids, SHORT)
    assert answer.finish_reason == "length" and answer.request_id == "shared"
    wait_idle(cluster)


def test_the_same_tenant_reusing_an_id_in_flight_is_refused(
    cluster: Cluster, engine: Engine
) -> None:
    long_ids, short_ids = prompt(3), prompt(4)

    async def acme_same_id() -> None:
        with pytest.raises(ServerError) as info:
            await short_request(cluster, "acme", short_ids, "mine")
        assert info.value.code is grpc.StatusCode.ALREADY_EXISTS
        # Refused by the router, before any placement (not by the worker holding the first).
        assert "'mine' is already in flight for this tenant" in info.value.message

    tokens, finish = asyncio.run(around_first_token(cluster, long_ids, "mine", acme_same_id))
    assert tokens == expected(engine, long_ids, LONG) and finish == "length"
    # Once the request has ended its id is free again.
    again = asyncio.run(short_request(cluster, "acme", short_ids, "mine"))
    assert again.token_ids == expected(engine, short_ids, SHORT)
    wait_idle(cluster)
