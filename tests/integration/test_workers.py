"""The worker services as real processes on loopback: kvstore, prefill, decode and a mixed
worker on the tiny model, heartbeating into the session's Redis.

Driven directly through the generated stubs (no router): Prefill then Decode must give the
tokens of ``Engine.generate`` alone; every store entry and every KV block must be freed
afterwards, on success, on bad input and on cancellation; a SIGTERM lets an in-flight stream
finish and removes the worker's heartbeat.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.client import KVStoreClient
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.registry import RedisWorkerRegistry, connect
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0
KV_BLOCKS = 1024
MAX_TOKENS = 8
T = TypeVar("T")


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    port_file: Path
    log: Path
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


@dataclass
class Cluster:
    redis_url: str
    namespace: str
    kvstore: Service
    prefill: Service
    decode: Service
    mixed: Service
    services: list[Service] = field(default_factory=list)


def _launch(name: str, module: str, args: list[str], tmp: Path) -> Service:
    port_file, log = tmp / f"{name}.port", tmp / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--port", "0", "--port-file", str(port_file), *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Service(name, proc, port_file, log)


def _wait_ready(services: list[Service], deadline: float) -> None:
    """Poll the port files (written once a service serves) until all exist or time is up."""
    pending = list(services)
    while pending:
        for s in list(pending):
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited with {s.proc.returncode}:\n{s.log_tail()}")
            if s.port_file.exists():
                s.port = int(s.port_file.read_text())
                pending.remove(s)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{pending[0].name} did not start:\n{pending[0].log_tail()}")
        time.sleep(0.05)  # polling child processes' port files; nothing to wait on


def _stop(service: Service) -> None:
    if service.proc.poll() is None:
        service.proc.terminate()
        try:
            service.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            service.proc.kill()
            service.proc.wait()


@pytest.fixture(scope="module")
def cluster(
    tiny_llama_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("workers")
    namespace = f"test-workers-{uuid.uuid4().hex[:8]}"
    common = [
        "--model", str(tiny_llama_dir), "--dtype", "float32", "--threads", "1",
        "--kv-blocks", str(KV_BLOCKS), "--redis-url", redis_url, "--namespace", namespace,
        "--heartbeat-interval-s", "0.2", "--grace-s", "60", "--log-level", "WARNING",
    ]  # fmt: skip
    services: list[Service] = []
    try:
        kvstore = _launch("kvstore", "services.kvstore", ["--capacity-bytes", "67108864"], tmp)
        services.append(kvstore)
        decode = _launch("decode", "services.decode", [*common, "--worker-id", "decode-0"], tmp)
        mixed = _launch(
            "mixed", "services.decode", [*common, "--role", "mixed", "--worker-id", "mixed-0"], tmp
        )
        services += [decode, mixed]
        deadline = time.monotonic() + START_TIMEOUT_S
        _wait_ready([kvstore], deadline)
        prefill_args = [
            "--worker-id",
            "prefill-0",
            "--kvstore",
            kvstore.address,
            "--max-wait-ms",
            "20",
        ]
        prefill = _launch("prefill", "services.prefill", [*common, *prefill_args], tmp)
        services.append(prefill)
        _wait_ready([decode, mixed, prefill], deadline)
        yield Cluster(redis_url, namespace, kvstore, prefill, decode, mixed, services)
    finally:
        for s in services:
            _stop(s)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=KV_BLOCKS)


# -- helpers ---------------------------------------------------------------------------------
def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=120))


async def eventually(
    probe: Callable[[], Awaitable[T | None]], what: str, timeout_s: float = 20
) -> T:
    """Poll ``probe`` until it returns something other than None, within a bounded time."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)  # polling a heartbeat written every 0.2 s


async def heartbeat(c: Cluster, worker_id: str) -> WorkerInfo | None:
    redis = connect(c.redis_url)
    try:
        return await RedisWorkerRegistry(redis, keys=KeySpace(c.namespace)).get(worker_id)
    finally:
        await redis.aclose()


async def all_blocks_free(c: Cluster, worker_id: str) -> WorkerInfo:
    async def probe() -> WorkerInfo | None:
        info = await heartbeat(c, worker_id)
        idle = info and info.kv_blocks_free == info.kv_blocks_total and info.running_seqs == 0
        return info if idle else None

    return await eventually(probe, f"{worker_id} to report all blocks free")


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2048) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = MAX_TOKENS) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def decode_request(
    rid: str, prompt: list[int], resp: prefill_pb2.PrefillResponse, max_tokens: int
) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        first_token_id=resp.first_token_id,
        first_logprob=resp.first_logprob,
        sampling=greedy(max_tokens),
        kv=resp.kv,
    )


# -- tests -----------------------------------------------------------------------------------
def test_prefill_then_decode_matches_engine_alone(cluster: Cluster, reference: Engine) -> None:
    ps = prompts(0, [5, 17, 33, 64])
    expected = reference.generate(
        ps, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    one_token = reference.generate(
        ps[1], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    )[0]

    async def body() -> None:
        async with (
            grpc.aio.insecure_channel(cluster.prefill.address) as pch,
            grpc.aio.insecure_channel(cluster.decode.address) as dch,
            KVStoreClient(cluster.kvstore.address) as store,
        ):
            prefill, decode = prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch)

            async def disaggregated(i: int, prompt: list[int]) -> list[int]:
                rid = f"pd-{i}"
                resp = await prefill.Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id=rid, prompt_token_ids=prompt, sampling=greedy()
                    ),
                    timeout=60,
                )
                assert resp.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
                # The key ends with the hand-off's capability: naming it takes the handle.
                assert len(resp.kv.capability) == 16
                assert resp.kv.store.key == f"kv/{rid}/{resp.kv.capability.hex()}"
                assert resp.kv.num_tokens == len(prompt)
                assert resp.transfer_bytes == resp.kv.num_bytes > 0
                chunks = [
                    c
                    async for c in decode.Decode(
                        decode_request(rid, prompt, resp, MAX_TOKENS), timeout=60
                    )
                ]
                assert [c.finish_reason for c in chunks[:-1]] == [0] * (len(chunks) - 1)
                assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
                assert chunks[-1].timing.transfer_bytes == resp.kv.num_bytes
                return [resp.first_token_id] + [t for c in chunks for t in c.token_ids]

            got = await asyncio.gather(*(disaggregated(i, p) for i, p in enumerate(ps)))
            assert got == [r.token_ids for r in expected]

            # max_tokens == 1: the first token ends the request, no KV is handed over.
            resp = await prefill.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="pd-one", prompt_token_ids=ps[1], sampling=greedy(1)
                ),
                timeout=60,
            )
            assert resp.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert not resp.HasField("kv") and resp.first_token_id == one_token.token_ids[0]

            assert (await store.stat()).num_entries == 0
        await all_blocks_free(cluster, "decode-0")
        await all_blocks_free(cluster, "prefill-0")

    run(body)


def test_cancelled_decode_frees_store_entry_and_blocks(cluster: Cluster) -> None:
    prompt = prompts(1, [40])[0]
    long = 8000  # minutes of decoding: only the cancellation can free the blocks in time

    async def body() -> None:
        async with (
            grpc.aio.insecure_channel(cluster.prefill.address) as pch,
            grpc.aio.insecure_channel(cluster.decode.address) as dch,
            KVStoreClient(cluster.kvstore.address) as store,
        ):
            resp = await prefill_pb2_grpc.PrefillStub(pch).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="cancel-me", prompt_token_ids=prompt, sampling=greedy(long)
                ),
                timeout=60,
            )
            assert (await store.stat(resp.kv.store.key)).exists
            call = decode_pb2_grpc.DecodeStub(dch).Decode(
                decode_request("cancel-me", prompt, resp, long), timeout=120
            )
            for _ in range(2):
                chunk = await call.read()
                assert chunk.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED

            async def decoding() -> WorkerInfo | None:
                info = await heartbeat(cluster, "decode-0")
                return info if info and info.running_seqs == 1 else None

            busy = await eventually(decoding, "decode-0 to report the running request")
            assert busy.kv_blocks_free < busy.kv_blocks_total
            call.cancel()
            assert not (await store.stat(resp.kv.store.key)).exists
        await all_blocks_free(cluster, "decode-0")

    run(body)


def test_bad_input_is_invalid_argument_naming_the_field(cluster: Cluster) -> None:
    async def body() -> None:
        async with (
            grpc.aio.insecure_channel(cluster.prefill.address) as pch,
            grpc.aio.insecure_channel(cluster.decode.address) as dch,
            KVStoreClient(cluster.kvstore.address) as store,
        ):
            prefill, decode = prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch)

            async def refused(
                call: Awaitable[object], code: grpc.StatusCode, field_name: str
            ) -> None:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == code
                assert field_name in (info.value.details() or "")

            bad_prefills = [
                ({"prompt_token_ids": []}, "prompt_token_ids"),
                ({"prompt_token_ids": [1, 5000]}, "prompt_token_ids"),
                ({"sampling": common_pb2.SamplingParams(temperature=-1.0)}, "temperature"),
                ({"sampling": common_pb2.SamplingParams(max_tokens=100_000)}, "max_tokens"),
                ({"request_id": ""}, "request_id"),
            ]
            for fields, name in bad_prefills:
                request = prefill_pb2.PrefillRequest(
                    **{"request_id": "bad", "prompt_token_ids": [1, 2, 3], **fields}
                )
                await refused(
                    prefill.Prefill(request, timeout=30), grpc.StatusCode.INVALID_ARGUMENT, name
                )

            missing_kv = decode_pb2.DecodeRequest(
                request_id="bad", prompt_token_ids=[1, 2], sampling=greedy()
            )
            await refused(
                decode.Decode(missing_kv, timeout=30).read(), grpc.StatusCode.INVALID_ARGUMENT, "kv"
            )

            # A refused decode still deletes the store entry its handle names.
            prompt = prompts(2, [12])[0]
            resp = await prefill.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="bad-first", prompt_token_ids=prompt, sampling=greedy()
                ),
                timeout=60,
            )
            request = decode_request("bad-first", prompt, resp, MAX_TOKENS)
            request.first_token_id = 10**6
            await refused(
                decode.Decode(request, timeout=30).read(),
                grpc.StatusCode.INVALID_ARGUMENT,
                "first_token",
            )
            assert not (await store.stat(resp.kv.store.key)).exists

            await store.put("kv/foreign", b"not a payload from this model")
            foreign = decode_request("foreign", prompt, resp, MAX_TOKENS)
            foreign.kv.store.key = "kv/foreign"
            foreign.kv.model_fingerprint = "another-model"
            await refused(
                decode.Decode(foreign, timeout=30).read(),
                grpc.StatusCode.FAILED_PRECONDITION,
                "fingerprint",
            )
            assert not (await store.stat("kv/foreign")).exists
            assert (await store.stat()).num_entries == 0
        await all_blocks_free(cluster, "decode-0")
        await all_blocks_free(cluster, "prefill-0")

    run(body)


def test_heartbeats_mixed_generate_and_graceful_sigterm(
    cluster: Cluster, reference: Engine
) -> None:
    prompt = prompts(3, [21])[0]
    n = 24
    expected = reference.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    )[0]

    async def body() -> None:
        roles = {
            "prefill-0": (WorkerRole.PREFILL, cluster.prefill),
            "decode-0": (WorkerRole.DECODE, cluster.decode),
            "mixed-0": (WorkerRole.MIXED, cluster.mixed),
        }
        infos = {}
        for worker_id, (role, service) in roles.items():
            info = await eventually(
                lambda w=worker_id: heartbeat(cluster, w), f"{worker_id}'s heartbeat"
            )
            assert (info.role, info.address, info.draining) == (role, service.address, False)
            assert (info.kv_blocks_total, info.block_size) == (KV_BLOCKS, 16)
            infos[worker_id] = info
        assert len({i.model_fingerprint for i in infos.values()}) == 1

        async with grpc.aio.insecure_channel(cluster.mixed.address) as ch:
            call = decode_pb2_grpc.MixedStub(ch).Generate(
                decode_pb2.ColocatedRequest(
                    request_id="mixed", prompt_token_ids=prompt, sampling=greedy(n)
                ),
                timeout=120,
            )
            first = await call.read()
            # SIGTERM while the stream is in flight: it still runs to its end.
            cluster.mixed.proc.send_signal(signal.SIGTERM)
            chunks = [first]
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
        assert [t for c in chunks for t in c.token_ids] == expected.token_ids
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert await asyncio.to_thread(cluster.mixed.proc.wait, 30) == 0
        assert await heartbeat(cluster, "mixed-0") is None

    run(body)
