"""The hand-off's two connectors end to end, on the in-memory fake of the transports
(``transfer.fake.fake_transports``, plugged in where the real ones are) and a real engine (the
tiny checkpoint): what a plan decides, what reaches the decode side (layer-wise, deferred,
without the prefix it caches), and every failure ending in a recompute that gives the same KV,
with nothing left in the hub."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.backends import TORCH, EngineBackend, recompute_kv
from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.handoff import (
    Arrival,
    DecodeConnector,
    HandoffPlan,
    HandoffRoute,
    PrefillConnector,
    Sent,
    TransferOptions,
)
from pdserve.kvstore.client import KVStoreClient
from pdserve.transfer.base import KVLocation, TransportKind
from pdserve.transfer.compress import Compression
from pdserve.transfer.fake import FakeHub, fake_transports
from pdserve.transfer.faults import SendFaults
from tests.unit.backends.conftest import open_backend, run
from tests.unit.transfer.conftest import assert_same_payload

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
PROMPT = tuple((7 * i + 3) % 1000 for i in range(41))
DECODE = "10.0.0.2:1"


@dataclass
class Sides:
    engine: EngineBackend
    hub: FakeHub
    prefill: PrefillConnector
    decode: DecodeConnector


@asynccontextmanager
async def sides(
    model: Path, faults: SendFaults | None = None, **options: object
) -> AsyncIterator[Sides]:
    """Both connectors on one engine (the same model on both sides), over one fake hub."""
    async with AsyncExitStack() as stack:
        engine = await stack.enter_async_context(open_backend(TORCH, model))
        hub = FakeHub()
        transports = fake_transports(hub, faults=faults, expected_layout=engine.layout)
        store = KVStoreClient("127.0.0.1:1", timeout_s=1)  # never dialled
        stack.push_async_callback(store.close)
        opts = TransferOptions(decode_prefix=False, **options)  # type: ignore[arg-type]
        prefill = PrefillConnector(engine, store, host="a", options=opts, transports=transports)
        stack.push_async_callback(prefill.close)
        decode = DecodeConnector(engine, host="b", transports=transports)
        stack.push_async_callback(decode.close)
        yield Sides(engine, hub, prefill, decode)
        assert hub.keys() == []  # nothing left in the wire, whatever the test did


async def hand_over(s: Sides, plan: HandoffPlan, kv: KVPayload) -> Sent:
    """The prefill side of ``plan``, the engine's layers being ``kv``."""
    async with s.prefill.open(plan) as out:
        hook = out.layer_hook
        if hook is not None:
            for i in range(kv.layout.num_layers):
                hook(i, kv.keys[i], kv.values[i])
        return await out.hand_over(time.monotonic_ns())


async def arrive(s: Sides, rid: str, location: KVLocation, tenant: str = "") -> Arrival:
    async with s.decode.incoming(location) as incoming:
        return await incoming.arrive(EngineRequest(rid, PROMPT, ONE, tenant=tenant))


def request(max_tokens: int) -> EngineRequest:
    return EngineRequest("r", PROMPT, SamplingParams(max_tokens=max_tokens))


def plan_of(kind: TransportKind = TransportKind.DIRECT, **changes: object) -> HandoffPlan:
    plan = HandoffPlan("r", len(PROMPT), kind, decode_address=DECODE, decode_host="b")
    return dataclasses.replace(plan, **changes)  # type: ignore[arg-type]


def test_the_plan_decides_once_from_the_request_and_the_settings(tiny_llama_dir: Path) -> None:
    async def body() -> None:
        async with sides(tiny_llama_dir, compression=Compression.INT8, layerwise=False) as s:
            plan = await s.prefill.plan(request(8), HandoffRoute(DECODE, "b"))
            assert (plan.kind, plan.compression, plan.layerwise) == (
                TransportKind.DIRECT, Compression.INT8, False
            )  # fmt: skip
            assert plan.decodes and not plan.announce and plan.peer == "b"
            same_host = await s.prefill.plan(request(8), HandoffRoute(DECODE, "a"))
            assert same_host.kind is TransportKind.SHM
            assert same_host.compression is Compression.NONE  # shm moves the bytes as they are
            unknown = await s.prefill.plan(request(1), HandoffRoute())  # no decode worker named
            assert unknown.kind is TransportKind.STORE and not unknown.decodes
            forced = await s.prefill.plan(request(8), HandoffRoute(transport="direct"))
            assert forced.kind is TransportKind.STORE  # nowhere to push to: the store
            asked = await s.prefill.plan(request(8), HandoffRoute(DECODE, transport="recompute"))
            assert asked.kind is TransportKind.RECOMPUTE
            assert asked.reason == "recompute was asked for"

    run(body)


@pytest.mark.parametrize("layerwise", [True, False])
def test_the_decode_side_gets_the_prompts_kv(tiny_llama_dir: Path, layerwise: bool) -> None:
    async def body() -> None:
        async with sides(tiny_llama_dir) as s:
            kv = await recompute_kv(s.engine, EngineRequest("ref", PROMPT, ONE, tenant="ref"))
            async with s.prefill.open(plan_of(layerwise=layerwise)) as out:
                hook = out.layer_hook
                assert hook is not None
                for i in range(kv.layout.num_layers):
                    hook(i, kv.keys[i], kv.values[i])
                hooked = time.monotonic_ns()
                sent = await out.hand_over(hooked)
            assert sent.location.kind is TransportKind.DIRECT and sent.num_bytes > kv.nbytes
            assert sent.location.model_fingerprint == s.engine.fingerprint
            assert sent.record.layerwise is layerwise
            # Deferred, the layers left at the hand-over, after the hook had them all.
            assert (sent.record.first_layer_ns > hooked) is not layerwise
            assert ("b", "direct") in {(p, k) for p, k, _ in s.prefill.links.published()}
            arrival = await arrive(s, "r", sent.location)
            assert arrival.record.transport == "direct" and not arrival.record.fallback_reason
            assert arrival.recompute_ms == 0.0 and isinstance(arrival.payload, KVPayload)
            assert_same_payload(arrival.payload, kv)
            # Both sides metered the bytes they moved, all of them inside the 10 s window.
            (sent_rate,) = s.prefill.bandwidth.rates()
            assert (sent_rate.link, sent_rate.transport) == ("b", "direct")
            assert sent_rate.average_bps == pytest.approx(sent.num_bytes / 10)
            (recv_rate,) = s.decode.bandwidth.rates()
            assert recv_rate.transport == "direct"
            assert recv_rate.average_bps == pytest.approx(arrival.record.num_bytes / 10)
            assert recv_rate.peak_bps >= recv_rate.average_bps > 0

    run(body)


def test_a_cached_prefix_stays_behind_and_is_joined_on_arrival(tiny_llama_dir: Path) -> None:
    async def body() -> None:
        async with sides(tiny_llama_dir) as s:
            async for _ in s.engine.generate(EngineRequest("warm", PROMPT, ONE, tenant="t")):
                pass  # the decode side ran this prompt before: its whole blocks are cached
            kv = await recompute_kv(s.engine, EngineRequest("ref", PROMPT, ONE, tenant="ref"))
            skip = (len(PROMPT) - 1) // s.engine.layout.block_size * s.engine.layout.block_size
            sent = await hand_over(s, plan_of(prefix_tokens=skip), kv)
            assert sent.location.prefix_tokens == skip
            assert sent.location.num_tokens == len(PROMPT) - skip
            arrival = await arrive(s, "r", sent.location, tenant="t")
            assert isinstance(arrival.payload, KVPayload) and arrival.record.transport == "direct"
            assert_same_payload(arrival.payload, kv)

    run(body)


@pytest.mark.parametrize(
    ("faults", "where", "why"),
    [
        (SendFaults(stall_prefix=""), "prefill", "within"),  # never committed
        (SendFaults(corrupt_prefix=""), "decode", "checksum"),  # caught by the frame check
    ],
)
def test_a_failed_hand_off_ends_in_the_same_kv_recomputed(
    tiny_llama_dir: Path, faults: SendFaults, where: str, why: str
) -> None:
    async def body() -> None:
        async with sides(tiny_llama_dir, faults=faults) as s:
            # Another tenant: the recompute on arrival finds none of its blocks cached.
            kv = await recompute_kv(s.engine, EngineRequest("ref", PROMPT, ONE, tenant="ref"))
            sent = await hand_over(s, plan_of(timeout_s=0.2), kv)
            if where == "prefill":
                assert sent.location.kind is TransportKind.RECOMPUTE and sent.num_bytes == 0
                assert why in sent.record.fallback_reason
                assert len(sent.location.capability) == 16  # the hand-off that fell back
            arrival = await arrive(s, "r", sent.location)
            assert arrival.record.transport == "recompute"
            assert why in arrival.record.fallback_reason
            assert arrival.recompute_ms > 0 and isinstance(arrival.payload, KVPayload)
            assert_same_payload(arrival.payload, kv)

    run(body)


def test_every_path_that_does_not_hand_over_frees_the_hand_off(tiny_llama_dir: Path) -> None:
    async def body() -> None:
        async with sides(tiny_llama_dir) as s:
            kv = await recompute_kv(s.engine, EngineRequest("ref", PROMPT, ONE, tenant="ref"))
            with pytest.raises(RuntimeError):
                async with s.prefill.open(plan_of()) as out:  # the prefill failed midway
                    assert s.hub.keys() != []
                    raise RuntimeError("the engine failed")
            assert s.hub.keys() == []
            async with s.prefill.open(plan_of()) as out:  # the first token ended the request
                hook = out.layer_hook
                assert hook is not None
                for i in range(kv.layout.num_layers):
                    hook(i, kv.keys[i], kv.values[i])
            assert s.hub.keys() == []
            sent = await hand_over(s, plan_of(), kv)
            async with s.decode.incoming(sent.location):  # the Decode call was refused
                assert s.hub.keys() != []
            assert s.hub.keys() == []

    run(body)


def test_a_store_this_worker_cannot_open_is_a_recompute_not_an_error(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A decode worker without the Mooncake package (``None`` in sys.modules fails its import)
    # is handed a hand-off in a Mooncake Store: not the caller's bad input, so it recomputes
    # the same KV, and it declines to prefetch it.
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)

    async def body() -> None:
        async with AsyncExitStack() as stack:
            engine = await stack.enter_async_context(open_backend(TORCH, tiny_llama_dir))
            decode = DecodeConnector(engine, host="b")
            stack.push_async_callback(decode.close)
            kv = await recompute_kv(engine, EngineRequest("ref", PROMPT, ONE, tenant="ref"))
            location = KVLocation(
                kind=TransportKind.STORE, request_id="r", num_tokens=len(PROMPT),
                num_bytes=1 << 20, model_fingerprint=engine.fingerprint,
                address="mooncake://127.0.0.1:1", key="r",
            )  # fmt: skip
            assert not (await decode.prefetch(location)).accepted
            async with decode.incoming(location) as incoming:
                arrival = await incoming.arrive(EngineRequest("r", PROMPT, ONE))
            assert arrival.record.transport == "recompute"
            assert "pdserve[mooncake]" in arrival.record.fallback_reason
            assert isinstance(arrival.payload, KVPayload)
            assert_same_payload(arrival.payload, kv)

    run(body)
