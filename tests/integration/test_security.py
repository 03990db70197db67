"""A secured cluster (``Cluster(tls_dir=..., api_keys=...)``: TLS everywhere, mutual TLS and
the internal token between services, API keys at the router, a password on Redis) on the
tiny preset, over real sockets; and ``pdserve up``'s insecure local mode.

* a client needs TLS with the cluster's CA and a valid API key, and gets the engine's tokens;
* the tenant is the key's: what the request claims is ignored, and ``usage.cached_tokens``
  never tells one tenant about another's prompts (the cross-tenant prefix oracle);
* every internal service refuses a caller without the cluster's credential (a certificate of
  the cluster's CA but not a member's, and no token) on every method but health;
* a tenant's quota refusal reaches the client as Overloaded naming the quota.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import Client, Overloaded, TlsConfig, Unauthenticated, Unavailable
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import Cluster
from pdserve.security.auth import bearer_metadata
from pdserve.security.certs import ClusterCerts
from pdserve.security.options import SecurityOptions
from pdserve.security.up import INSECURE_WARNING
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

pytestmark = pytest.mark.integration

WORKER_ARGS = (
    "--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
    "--heartbeat-interval-s", "0.2",
)  # fmt: skip
KEYS = {tenant: f"k-{tenant}-{secrets.token_hex(12)}" for tenant in ("acme", "globex", "small")}
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("secured")
    keys_file = tmp / "keys.yaml"
    keys_file.write_text(
        "keys:\n"
        + "".join(f'  "{key}": {tenant}\n' for tenant, key in KEYS.items())
        + "tenants:\n  small: {max_reservations: 1}\n"
    )
    with Cluster(
        tiny_llama_dir, worker_args=WORKER_ARGS, log_level="WARNING",
        tls_dir=tmp / "tls", api_keys=keys_file,
    ) as c:  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def certs(cluster: Cluster) -> ClusterCerts:
    assert cluster.certs is not None
    return cluster.certs


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=256)


def prompt(seed: int, n: int = 96) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2000) for _ in range(n)]


def client(cluster: Cluster, certs: ClusterCerts, tenant: str | None, **kwargs: Any) -> Client:
    key = KEYS[tenant] if tenant is not None else None
    return Client(
        cluster.router_address, api_key=key, tls=TlsConfig(ca=certs.ca), timeout=60, **kwargs
    )


def test_a_client_needs_tls_and_a_valid_key(
    cluster: Cluster, certs: ClusterCerts, engine: Engine
) -> None:
    ids = prompt(1, 20)
    expected = engine.generate(
        [ids], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )[0].token_ids
    with client(cluster, certs, "acme") as c:
        done = c.generate(ids, max_tokens=6, temperature=0, ignore_eos=True)
    assert done.token_ids == expected and done.finish_reason == "length"

    refusals: list[tuple[Client, type[Exception]]] = [
        (client(cluster, certs, None), Unauthenticated),
        (Client(cluster.router_address, api_key="k-" + "0" * 30, tls=TlsConfig(ca=certs.ca),
                timeout=30), Unauthenticated),
        (Client(cluster.router_address, api_key=KEYS["acme"], timeout=30), Unavailable),
        # TLS, but trusting only the system's CAs: the cluster's certificate does not verify.
        (Client(cluster.router_address, api_key=KEYS["acme"], tls=True, timeout=30),
         Unavailable),
    ]  # fmt: skip
    for c, error in refusals:
        with c, pytest.raises(error):
            c.generate(ids, max_tokens=2)


def test_every_transport_works_over_mutual_tls(
    cluster: Cluster, certs: ClusterCerts, engine: Engine
) -> None:
    """KV streams into the KV store and into the decode worker's endpoint (our own chunk
    codec, the token as call credentials), and shm, between services over mutual TLS."""
    member = cluster.security
    ids = prompt(11, 40)
    expected = engine.generate(
        [ids], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )[0].token_ids
    greedy = common_pb2.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def one(transport: str) -> tuple[str, list[int]]:
        rid = f"tls-{transport}"
        async with (
            member.aio_channel(cluster.scheduler_address) as sch,
            member.aio_channel(cluster.workers("prefill")[0].address) as pch,
            member.aio_channel(cluster.workers("decode")[0].address) as dch,
        ):
            scheduler = scheduler_pb2_grpc.SchedulerStub(sch)
            assigned = await scheduler.Assign(
                scheduler_pb2.AssignRequest(request_id=rid, prompt_tokens=len(ids), max_tokens=6),
                timeout=30,
            )
            resp = await prefill_pb2_grpc.PrefillStub(pch).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=ids, sampling=greedy, transport=transport,
                    reservation_id=assigned.reservation_id, decode_host=assigned.decode.host,
                    decode_address=assigned.decode.address,
                ),
                timeout=30,
            )  # fmt: skip
            tokens, moved = [resp.first_token_id], ""
            async for chunk in decode_pb2_grpc.DecodeStub(dch).Decode(
                decode_pb2.DecodeRequest(
                    request_id=rid, prompt_token_ids=ids, first_token_id=resp.first_token_id,
                    first_logprob=resp.first_logprob, sampling=greedy, kv=resp.kv,
                    reservation_id=assigned.reservation_id,
                ),
                timeout=30,
            ):  # fmt: skip
                tokens += chunk.token_ids
                if chunk.HasField("timing"):
                    moved = chunk.timing.transport
            await scheduler.Release(
                scheduler_pb2.ReleaseRequest(reservation_id=assigned.reservation_id), timeout=30
            )
        return moved, tokens

    async def body() -> None:
        for transport in ("store", "direct", "shm"):
            assert await one(transport) == (transport, expected)

    asyncio.run(asyncio.wait_for(body(), 120))


def router_call(
    cluster: Cluster, certs: ClusterCerts, key: str, ids: list[int], *, claimed: str
) -> router_pb2.GenerateResponse:
    """GenerateUnary claiming tenant ``claimed`` in the request and in the metadata."""
    creds = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    with grpc.secure_channel(cluster.router_address, creds) as channel:
        return router_pb2_grpc.RouterStub(channel).GenerateUnary(
            router_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=ids),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=2),
                tenant=claimed,
            ),
            metadata=[bearer_metadata(key), ("x-pdserve-tenant", claimed)],
            timeout=60,
        )


def test_the_cross_tenant_prefix_oracle_is_closed(cluster: Cluster, certs: ClusterCerts) -> None:
    """Other tenants replay acme's prompt, one claiming to be acme: their cached_tokens say
    nothing of it."""
    secret = prompt(7)
    first = router_call(cluster, certs, KEYS["acme"], secret, claimed="acme")
    assert first.usage.cached_tokens == 0  # a prompt nobody sent before
    # The positive control: acme's own repeat is served from the prefix cache.
    again = router_call(cluster, certs, KEYS["acme"], secret, claimed="acme")
    assert again.usage.cached_tokens > 0
    # The right guess, by globex claiming to be acme (in the request and the metadata), and
    # by another tenant claiming nothing: as cold as a wrong guess.
    assert router_call(cluster, certs, KEYS["globex"], secret, claimed="acme").usage == (
        common_pb2.Usage(prompt_tokens=len(secret), completion_tokens=2, cached_tokens=0)
    )
    assert router_call(cluster, certs, KEYS["small"], secret, claimed="").usage.cached_tokens == 0
    # globex's own repeat now hits globex's own cache: isolation, not a disabled cache.
    repeat = router_call(cluster, certs, KEYS["globex"], secret, claimed="acme")
    assert repeat.usage.cached_tokens == again.usage.cached_tokens


def stranger(certs: ClusterCerts) -> SecurityOptions:
    """A certificate of the cluster's CA (``pdserve-client``, not a member) and no token."""
    return SecurityOptions(tls=TlsConfig(cert=certs.client_cert, key=certs.client_key, ca=certs.ca))


async def codes_of(calls: list[Callable[[], Awaitable[Any]]]) -> list[grpc.StatusCode]:
    codes = []
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call()
        codes.append(err.value.code())
    return codes


def internal_calls(
    cluster: Cluster, channels: dict[str, grpc.aio.Channel]
) -> list[Callable[[], Awaitable[Any]]]:
    """Every method of every internal service, once (each must be refused to a stranger)."""
    sched = scheduler_pb2_grpc.SchedulerStub(channels["scheduler"])
    prefill = prefill_pb2_grpc.PrefillStub(channels["prefill"])
    decode = decode_pb2_grpc.DecodeStub(channels["decode"])
    handle = common_pb2.KVHandle(request_id="x", recompute=common_pb2.RecomputeLocation(reason="r"))

    async def read_all(stream: Any) -> None:
        async for _ in stream:
            pass

    calls: list[Callable[[], Awaitable[Any]]] = [
        lambda: sched.Assign(scheduler_pb2.AssignRequest(request_id="x", prompt_tokens=4,
                                                         max_tokens=4), timeout=10),
        lambda: sched.Release(scheduler_pb2.ReleaseRequest(reservation_id="x"), timeout=10),
        lambda: sched.Renew(scheduler_pb2.RenewRequest(reservation_id="x"), timeout=10),
        lambda: sched.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=10),
        lambda: prefill.Prefill(prefill_pb2.PrefillRequest(request_id="x", prompt_token_ids=[1]),
                                timeout=10),
        lambda: read_all(decode.Decode(decode_pb2.DecodeRequest(request_id="x", kv=handle),
                                       timeout=10)),
        lambda: decode.Prefetch(decode_pb2.PrefetchRequest(kv=handle), timeout=10),
        lambda: decode.CachedPrefix(decode_pb2.CachedPrefixRequest(kv_fingerprint="x",
                                                                   block_size=8), timeout=10),
    ]  # fmt: skip
    kv = kvstore_pb2_grpc.KVStoreStub(channels["kvstore"])

    async def one_chunk() -> Any:
        yield kvstore_pb2.KVChunk(key="kv/x", last=True)

    calls += [
        lambda: kv.Stat(kvstore_pb2.StatRequest(), timeout=10),
        lambda: kv.Delete(kvstore_pb2.DeleteRequest(key="kv/x"), timeout=10),
        lambda: kv.Lookup(kvstore_pb2.LookupRequest(keys=["kv/x"]), timeout=10),
        lambda: read_all(kv.Get(kvstore_pb2.GetRequest(key="kv/x"), timeout=10)),
        lambda: kv.Put(one_chunk(), timeout=10),
        # the decode worker's inbox of direct hand-offs
        lambda: decode.Push(one_chunk(), timeout=10),
        lambda: decode.Drop(kvstore_pb2.DeleteRequest(key="kv/x"), timeout=10),
        lambda: decode.InboxStat(decode_pb2.InboxStatRequest(), timeout=10),
    ]
    return calls


def test_every_internal_service_refuses_strangers(cluster: Cluster, certs: ClusterCerts) -> None:
    addresses = {
        "scheduler": cluster.scheduler_address,
        "kvstore": cluster.kvstore_address,
        "prefill": cluster.workers("prefill")[0].address,
        "decode": cluster.workers("decode")[0].address,
    }

    async def body() -> None:
        outsider = stranger(certs)
        channels = {n: outsider.aio_channel(a) for n, a in addresses.items()}
        try:
            codes = await codes_of(internal_calls(cluster, channels))
            assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}, codes
            for channel in channels.values():  # probes still see health
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            for channel in channels.values():
                await channel.close()
        # No client certificate at all: the handshake fails (mutual TLS), health included.
        anonymous = SecurityOptions(tls=TlsConfig(ca=certs.ca), internal_token="t" * 32)
        async with anonymous.aio_channel(addresses["scheduler"]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # The cluster's own credential (certificate and token) is let in.
        async with cluster.security.aio_channel(addresses["scheduler"]) as channel:
            listed = await scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
                scheduler_pb2.ListWorkersRequest(), timeout=10
            )
            assert {w.role for w in listed.workers} == {
                common_pb2.WORKER_ROLE_PREFILL,
                common_pb2.WORKER_ROLE_DECODE,
            }

    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_quota_refusal_names_the_quota(cluster: Cluster, certs: ClusterCerts) -> None:
    with client(cluster, certs, "small") as small, client(cluster, certs, "globex") as other:
        with small.stream(prompt(3, 8), max_tokens=200, ignore_eos=True) as held:
            next(iter(held))  # its reservation is live while it streams
            with pytest.raises(Overloaded, match="max_reservations=1"):
                small.generate(prompt(4, 8), max_tokens=2)
            assert other.generate(prompt(5, 8), max_tokens=2).finish_reason == "length"
            held.cancel()
        deadline = time.monotonic() + 30
        while True:  # the router releases the cancelled request's reservation on its way out
            try:
                assert small.generate(prompt(6, 8), max_tokens=2).finish_reason == "length"
                break
            except Overloaded:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # polling the router: the release is not observable otherwise


# -- pdserve up's insecure local mode ----------------------------------------------------------


def test_pdserve_up_prints_one_insecure_mode_warning(tiny_llama_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT / 'src'}{os.pathsep}{REPO_ROOT}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", str(tiny_llama_dir), "--port",
         "0", "--no-http", "--log-dir", str(tmp_path / "logs"),
         *(f"--worker-arg={a}" for a in ("--dtype=float32", "--threads=1", "--kv-blocks=64"))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            if line.startswith("pdserve is up"):
                address = line.split("router at ")[1].split()[0]
                break
            assert time.monotonic() < deadline, "pdserve up did not come up"
        else:
            pytest.fail(f"pdserve up exited: {proc.stderr.read()}")
        assert address.startswith("127.0.0.1:")  # loopback only
        with Client(address, timeout=60) as c:
            assert c.generate("hello", max_tokens=2).finish_reason == "length"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        warnings = [ln for ln in proc.stderr.read().splitlines() if "warning" in ln.lower()]
        assert warnings == [INSECURE_WARNING]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
