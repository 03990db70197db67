"""The scheduler's side of security against a real Redis: tenant quotas (also across two
replicas), a reservation's maximum lifetime, the reserved decode address a prefill worker
checks, and Redis with a password, and over TLS (``rediss://``) through a real TLS socket."""

from __future__ import annotations

import asyncio
import json
import ssl
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, ResponseError

from pdserve.errors import UnknownRequestError
from pdserve.handoff.assignment import AssignedDecode
from pdserve.quotas import QuotaExceededError, TenantQuota, TenantQuotas
from pdserve.redis_server import EmbeddedRedis
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.registry import RedisWorkerRegistry, connect
from pdserve.scheduling.reservations import assigned_decode_addresses
from pdserve.scheduling.scheduler import ClusterScheduler
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.security.certs import ClusterCerts, make_certs
from tests.integration.test_scheduler_redis import (
    BLOCKS_PER_REQUEST,
    MAX_TOKENS,
    PROMPT,
    make_worker,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def keys() -> KeySpace:
    return KeySpace(f"test-sec-{uuid.uuid4().hex[:10]}")


def run(redis_url: str, body: Callable[[Redis], Awaitable[None]]) -> None:
    async def main() -> None:
        redis = connect(redis_url)
        try:
            await asyncio.wait_for(body(redis), 60)
        finally:
            await redis.aclose()

    asyncio.run(main())


async def two_workers(redis: Redis, keys: KeySpace, free_blocks: int = 1000) -> None:
    registry = RedisWorkerRegistry(redis, keys=keys)
    await registry.heartbeat(make_worker("p", WorkerRole.PREFILL, 1000), ttl_s=60)
    await registry.heartbeat(make_worker("d", WorkerRole.DECODE, free_blocks), ttl_s=60)


def scheduler(redis: Redis, keys: KeySpace, **kwargs: Any) -> ClusterScheduler:
    return ClusterScheduler(redis, keys=keys, refresh_interval_s=0.0, **kwargs)


def test_max_reservations_per_tenant_holds_across_replicas(redis_url: str, keys: KeySpace) -> None:
    quotas = TenantQuotas(per_tenant={"acme": TenantQuota(max_reservations=2)})

    async def body(redis: Redis) -> None:
        await two_workers(redis, keys)
        replicas = [scheduler(redis, keys, quotas=quotas) for _ in range(2)]
        attempts = [
            replicas[i % 2].assign(f"acme-{i}", PROMPT, MAX_TOKENS, tenant="acme") for i in range(6)
        ]
        outcomes = await asyncio.gather(*attempts, return_exceptions=True)
        placed = [o for o in outcomes if not isinstance(o, BaseException)]
        refused = [o for o in outcomes if isinstance(o, QuotaExceededError)]
        assert len(placed) == 2 and len(refused) == 4  # never more than the quota
        assert "max_reservations=2" in str(refused[0]) and "'acme'" in str(refused[0])
        # Another tenant is not held back by acme's quota (no quota of its own).
        await replicas[0].assign("globex-0", PROMPT, MAX_TOKENS, tenant="globex")
        # A release gives the room back.
        assert await replicas[1].release(placed[0].reservation_id)
        await replicas[0].assign("acme-again", PROMPT, MAX_TOKENS, tenant="acme")
        with pytest.raises(QuotaExceededError):
            await replicas[0].assign("acme-over", PROMPT, MAX_TOKENS, tenant="acme")

    run(redis_url, body)


def test_max_kv_blocks_counts_the_decode_share(redis_url: str, keys: KeySpace) -> None:
    # Room for one request's decode blocks, not two.
    quota = TenantQuota(max_kv_blocks=BLOCKS_PER_REQUEST + BLOCKS_PER_REQUEST // 2)

    async def body(redis: Redis) -> None:
        await two_workers(redis, keys)
        s = scheduler(redis, keys, quotas=TenantQuotas(default=quota))
        first = await s.assign("a-0", PROMPT, MAX_TOKENS, tenant="a")
        with pytest.raises(QuotaExceededError, match="max_kv_blocks"):
            await s.assign("a-1", PROMPT, MAX_TOKENS, tenant="a")
        # The prefill share goes; the decode share (the quota's blocks) stays.
        assert await s.release(first.reservation_id, prefill_only=True)
        with pytest.raises(QuotaExceededError, match="max_kv_blocks"):
            await s.assign("a-2", PROMPT, MAX_TOKENS, tenant="a")
        assert await s.release(first.reservation_id)
        await s.assign("a-3", PROMPT, MAX_TOKENS, tenant="a")

    run(redis_url, body)


def test_renew_never_outlives_the_maximum_lifetime(redis_url: str, keys: KeySpace) -> None:
    async def age(redis: Redis, reservation_id: str, by_s: float) -> None:
        """Make the reservation look ``by_s`` older (its record's creation time)."""
        key = keys.reservation(reservation_id)
        record = json.loads(await redis.get(key))
        record["created_ms"] -= by_s * 1000
        await redis.set(key, json.dumps(record), keepttl=True)

    async def body(redis: Redis) -> None:
        await two_workers(redis, keys)
        s = scheduler(redis, keys, reservation_ttl_s=120.0, reservation_max_lifetime_s=600.0)
        a = await s.assign("long", PROMPT, MAX_TOKENS)
        assert await s.renew(a.reservation_id) == pytest.approx(120.0, abs=1.0)
        await age(redis, a.reservation_id, 590.0)  # 10 s of its lifetime left
        left = await s.renew(a.reservation_id)
        assert 0 < left <= 10.0
        ttl_ms = await redis.pttl(keys.reservation(a.reservation_id))
        assert 0 < ttl_ms <= 10_000
        await age(redis, a.reservation_id, 20.0)  # past it
        with pytest.raises(UnknownRequestError, match="maximum lifetime"):
            await s.renew(a.reservation_id)

    run(redis_url, body)


def test_the_reservation_names_its_decode_address(redis_url: str, keys: KeySpace) -> None:
    async def body(redis: Redis) -> None:
        await two_workers(redis, keys)
        s = scheduler(redis, keys)
        a = await s.assign("r", PROMPT, MAX_TOKENS)
        decode_address = make_worker("d", WorkerRole.DECODE, 1).address
        assert await assigned_decode_addresses(redis, keys, a.reservation_id) == {decode_address}
        assert await assigned_decode_addresses(redis, keys, "no-such") is None
        check = AssignedDecode(redis, keys)
        assert await check.refusal(a.reservation_id, decode_address) is None
        for rid, address in [
            (a.reservation_id, "127.0.0.1:1"),  # not the reserved worker
            (a.reservation_id, a.prefill.address),  # the prefill worker is not a decode target
            ("forged", decode_address),
            ("", decode_address),
        ]:
            assert await check.refusal(rid, address) is not None
        assert check.refused == 4
        assert await s.release(a.reservation_id)
        assert await check.refusal(a.reservation_id, decode_address) is not None

    run(redis_url, body)


# -- Redis AUTH and TLS ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def protected_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(password=uuid.uuid4().hex) as server:
        yield server


def test_redis_with_a_password(protected_redis: EmbeddedRedis, keys: KeySpace) -> None:
    assert protected_redis.password and protected_redis.password in protected_redis.url

    async def body() -> None:
        anonymous = connect(f"redis://127.0.0.1:{protected_redis.port}/0")
        try:
            with pytest.raises((AuthenticationError, ResponseError)):
                await anonymous.ping()
        finally:
            await anonymous.aclose()
        wrong = connect(f"redis://:nope-{uuid.uuid4().hex}@127.0.0.1:{protected_redis.port}/0")
        try:
            with pytest.raises((AuthenticationError, ResponseError)):
                await wrong.ping()
        finally:
            await wrong.aclose()

    asyncio.run(body())

    async def works(redis: Redis) -> None:
        await two_workers(redis, keys)
        a = await scheduler(redis, keys).assign("r", PROMPT, MAX_TOKENS)
        assert a.decode.id == "d"

    run(protected_redis.url, works)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    return make_certs(tmp_path_factory.mktemp("redis-tls"))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


def test_rediss_url_through_a_tls_socket(
    protected_redis: EmbeddedRedis, certs: ClusterCerts, keys: KeySpace
) -> None:
    """``rediss://`` with a private CA (``ssl_ca_certs``): a TLS terminator in front of the
    embedded Redis (whose build has no TLS of its own), real handshakes both ways round."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.node_cert, certs.node_key)
    handshakes: list[str] = []

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handshakes.append(str(writer.get_extra_info("ssl_object").version()))
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", protected_redis.port)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    async def body() -> None:
        server = await asyncio.start_server(relay, "127.0.0.1", 0, ssl=context)
        port = server.sockets[0].getsockname()[1]
        password = protected_redis.password
        url = f"rediss://:{password}@127.0.0.1:{port}/0?ssl_ca_certs={certs.ca}"
        redis = connect(url)
        try:
            await two_workers(redis, keys)
            a = await scheduler(redis, keys).assign("tls", PROMPT, MAX_TOKENS)
            assert a.decode.id == "d" and handshakes and handshakes[0].startswith("TLS")
            plain = connect(f"redis://:{password}@127.0.0.1:{port}/0")  # no TLS: refused
            try:
                with pytest.raises(Exception):  # noqa: B017 - any failure: it must not work
                    await plain.ping()
            finally:
                await plain.aclose()
        finally:
            await redis.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(body())
