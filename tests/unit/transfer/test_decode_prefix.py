"""Prefix reuse from the decode worker: what its engine says it caches, the prefix it copies
out, the suffix a hand-off moves, and the joined payload against an independent export."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

from pdserve.backends.pytorch import TorchBackend
from pdserve.engine.engine import Engine
from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine_loop.async_engine import AsyncEngine
from pdserve.errors import InvalidArgumentError, UnknownRequestError
from pdserve.handoff import HandoffPlan, PrefillConnector
from pdserve.kvstore.client import KVStoreClient
from pdserve.prefix import decode as decode_prefix
from pdserve.transfer.base import Transport, TransportKind, TransportRegistry
from pdserve.transfer.shm.handoff import ShmReceiver, ShmSender
from pdserve.transfer.shm.reader import SegmentReader
from pdserve.transfer.shm.writer import SegmentWriter
from tests.unit.transfer.conftest import assert_same_payload, leftovers

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2048) for _ in range(n)]


def load(model_dir: Path) -> Engine:
    return Engine.from_pretrained(model_dir, dtype="float32", num_kv_blocks=64, block_size=8)


def full_export(model_dir: Path, ids: list[int]) -> KVPayload:
    """The prompt's KV from a separate engine (the independent reference)."""
    ref = load(model_dir)
    ref.add_request("ref", ids, ONE, hold_kv=True)
    while ref.has_unfinished():
        ref.step()
    payload = ref.export_kv("ref")
    ref.release_kv("ref")
    return payload


def cut(payload: KVPayload, start: int, end: int) -> KVPayload:
    n = payload.layout.num_layers
    return KVPayload(
        payload.layout,
        end - start,
        tuple(payload.keys[i][start:end] for i in range(n)),
        tuple(payload.values[i][start:end] for i in range(n)),
    )


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=120))


def test_engine_reports_and_exports_its_cached_prefix(tiny_llama_dir: Path) -> None:
    engine = load(tiny_llama_dir)
    ids = prompt(1, 45)  # 5 whole blocks of 8 before the last token
    engine.add_request("a", ids, ONE, tenant="t1")
    while engine.has_unfinished():
        engine.step()
    hashes = decode_prefix.prompt_block_hashes(ids, 8, "t1")
    assert len(hashes) == 5
    assert engine.cached_prefix_blocks(hashes) == 5
    assert engine.cached_prefix_blocks(decode_prefix.prompt_block_hashes(ids, 8, "t2")) == 0
    longer = [*ids[:24], *prompt(2, 30)]  # shares 3 blocks, then differs
    assert engine.cached_prefix_blocks(decode_prefix.prompt_block_hashes(longer, 8, "t1")) == 3

    prefix = engine.export_cached_prefix(hashes[:3])
    assert prefix is not None and prefix.num_tokens == 24
    reference = full_export(tiny_llama_dir, ids)
    assert_same_payload(prefix, cut(reference, 0, 24))
    assert engine.export_cached_prefix([b"\0" * len(hashes[0])]) is None
    engine.check_no_leaks()


def test_a_plan_with_a_cached_prefix_moves_only_the_tokens_after_it(
    tiny_llama_dir: Path, shm_prefix: str
) -> None:
    reference = full_export(tiny_llama_dir, prompt(3, 30))
    layout = reference.layout

    async def body() -> None:
        ae = AsyncEngine(load(tiny_llama_dir))
        ae.start()
        backend = TorchBackend(ae)
        shm = Transport(sender=lambda _: ShmSender(SegmentWriter(prefix=shm_prefix)))
        registry = TransportRegistry({TransportKind.SHM: shm})
        store = KVStoreClient("127.0.0.1:1", timeout_s=1)  # never dialled
        connector = PrefillConnector(backend, store, host="h", transports=registry)
        try:
            plan = HandoffPlan("r", 30, TransportKind.SHM, decode_host="h", prefix_tokens=16)
            async with connector.open(plan) as out:
                hook = out.layer_hook
                assert hook is not None
                for i in range(layout.num_layers):
                    hook(i, reference.keys[i], reference.values[i])
                sent = await out.hand_over(time.monotonic_ns())
            location = sent.location
            assert location.kind is TransportKind.SHM
            assert location.num_tokens == 14 and location.prefix_tokens == 16
            got = await ShmReceiver(SegmentReader(), location).receive(5.0)
            assert_same_payload(got, cut(reference, 16, 30))
            with pytest.raises(InvalidArgumentError) as err:
                dataclasses.replace(plan, prefix_tokens=30)  # nothing would be left to send
            assert err.value.field == "prefix_tokens"
            assert leftovers(shm_prefix) == []
        finally:
            await connector.close()
            await store.close()
            await ae.close()

    run(body)


def test_decode_worker_answers_and_joins(tiny_llama_dir: Path) -> None:
    ids = prompt(4, 41)
    reference = full_export(tiny_llama_dir, ids)

    async def body() -> None:
        ae = AsyncEngine(load(tiny_llama_dir))
        ae.start()
        backend = TorchBackend(ae)
        try:
            async for _ in ae.generate(EngineRequest("warm", ids, ONE, tenant="t")):
                pass  # the decode worker ran this prompt before: its blocks are cached
            oracle = decode_prefix.DecodePrefixOracle(backend)
            query = decode_prefix.prefix_query(ae.layout, ids, "t")
            assert len(query.block_hashes) == 5 and await oracle(query) == 5
            assert await oracle(decode_prefix.prefix_query(ae.layout, ids, "u")) == 0
            other_size = dataclasses.replace(query, block_size=16)
            assert await oracle(other_size) == 0  # another block size: nothing of ours
            other_model = dataclasses.replace(query, kv_fingerprint="another")
            assert await oracle(other_model) == 0

            class Clients:  # answers as the decode worker at "d" would
                async def cached_prefix(self, address: str, q: decode_prefix.PrefixQuery) -> int:
                    assert address == "d"
                    return await oracle(q)

            assert await decode_prefix.ask(Clients(), "d", ae.layout, ids, "t") == 40
            assert await decode_prefix.ask(Clients(), "d", ae.layout, ids, "u") == 0

            joined = await decode_prefix.join_cached_prefix(
                backend, cut(reference, 40, 41), ids, 40, "t"
            )
            assert_same_payload(joined, reference)
            with pytest.raises(UnknownRequestError, match="evicted"):
                await decode_prefix.join_cached_prefix(
                    backend, cut(reference, 40, 41), ids, 40, "u"
                )
            with pytest.raises(UnknownRequestError, match="does not make"):
                await decode_prefix.join_cached_prefix(
                    backend, cut(reference, 36, 41), ids, 36, "t"
                )
        finally:
            await ae.close()
        ae.engine.check_no_leaks()
        assert np.array_equal(joined.keys[0][:40], reference.keys[0][:40])

    run(body)
