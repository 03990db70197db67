"""The KV hand-off between two engines in one process, over each transport, through the real
servicers on loopback (the KVStore servicer for store, the decode worker's Decode servicer,
whose Push takes direct hand-offs).

Greedy tokens after a hand-off must be those of the engine alone; a corrupted frame, a stalled
or cut-off stream and an unreachable store must each end in recompute with the same tokens;
afterwards no store entry, pending write, shm segment or KV block may be left.
"""

from __future__ import annotations

import asyncio
import random
import socket
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdserve.backends.pytorch import TorchBackend
from pdserve.engine.engine import Engine
from pdserve.engine.kv_arrays import host_array
from pdserve.engine.kv_payload import KVLayout
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine_loop.async_engine import AsyncEngine
from pdserve.errors import KVTransferError
from pdserve.handoff import DecodeConnector, HandoffRoute, PrefillConnector, TransferOptions
from pdserve.kvstore.client import KVStoreClient
from pdserve.kvstore.store import KVStore
from pdserve.kvstore.wire import add_kvstore_servicer
from pdserve.rpc.server import AddServicerFn, build_server
from pdserve.transfer.base import TransportKind
from pdserve.transfer.compress import Compression
from pdserve.transfer.faults import SendFaults
from pdserve.transfer.janitor import SHM_DIR, segment_name
from pdserve.transfer.stream import frames
from pdserve.transfer.stream import sender as stream_sender
from pdserve.transfer.stream.frames import (
    FRAME_HEAD,
    FrameCollector,
    LayerCopy,
    frame_bytes,
    stream_bytes,
)
from pdserve.transfer.stream.header import StreamHeader
from pdserve.transfer.stream.inbox import Inbox
from pdserve.transfer.stream.sender import StreamSender
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.prefill import PrefillResult, PrefillWorker
from services.decode.servicer import DecodeServicer, add_decode_servicer
from services.kvstore.servicer import KVStoreServicer
from tests.unit.transfer.stream.test_frames import received

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LENGTHS = [7, 33, 90]
HOST = socket.gethostname()


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2048) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    engine = Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    return [r.token_ids for r in engine.generate(prompts(0, LENGTHS), GREEDY)]


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), timeout=120))


@dataclass
class Pair:
    prefill: PrefillWorker
    decode: DecodeWorker
    store: KVStore
    inbox: Inbox
    inbox_address: str
    engines: tuple[AsyncEngine, AsyncEngine]


async def _serve(
    stack: AsyncExitStack, servicer: object, add: AddServicerFn = add_kvstore_servicer
) -> str:
    server, port, _ = build_server([(add, servicer)], port=0)
    await server.start()
    stack.push_async_callback(server.stop, None)
    return f"127.0.0.1:{port}"


@asynccontextmanager
async def pair(
    model: Path, options: TransferOptions, *, store_address: str = ""
) -> AsyncIterator[Pair]:
    """A prefill and a decode worker, each with its own engine, and their KV endpoints."""
    async with AsyncExitStack() as stack:
        engines = []
        for _ in range(2):
            ae = AsyncEngine(Engine.from_pretrained(model, dtype="float32", num_kv_blocks=64))
            ae.start()
            stack.push_async_callback(ae.close)
            engines.append(ae)
        store = KVStore(64 * 1024**2)
        # As the decode service does: direct hand-offs are pushed and assembled as they land.
        inbox = Inbox(64 * 1024**2, expected_layout=engines[1].layout)
        address = store_address or await _serve(stack, KVStoreServicer(store))
        client = KVStoreClient(address, timeout_s=5)
        stack.push_async_callback(client.close)
        p_engine = TorchBackend(engines[0])
        prefill = PrefillWorker(
            p_engine, PrefillConnector(p_engine, client, host=HOST, options=options)
        )
        stack.push_async_callback(prefill.close)
        d_engine = TorchBackend(engines[1])
        decode = DecodeWorker(d_engine, DecodeConnector(d_engine, inbox=inbox, host=HOST))
        stack.push_async_callback(decode.close)
        inbox_address = await _serve(stack, DecodeServicer(decode), add_decode_servicer)
        yield Pair(prefill, decode, store, inbox, inbox_address, (engines[0], engines[1]))
        # Nothing may be left behind, whatever the test did.
        for s in (store, inbox):
            stats = s.stats()
            assert (stats.num_entries, stats.num_writing, stats.used_bytes) == (0, 0, 0)
        assert not list(SHM_DIR.glob(segment_name("x").rsplit("-", 1)[0] + "-*"))
    for ae in engines:
        ae.engine.check_no_leaks()


async def hand_off(
    p: Pair, rid: str, prompt: list[int], transport: str
) -> tuple[list[int], PrefillResult, object]:
    """Prefill then decode: every token, the prefill's result, the decode's final timing."""
    request = EngineRequest(rid, tuple(prompt), GREEDY)
    result = await p.prefill.prefill(request, HandoffRoute(p.inbox_address, HOST, transport))
    assert result.kv is not None
    tokens = [result.first_token_id]
    timing = None
    stream = p.decode.decode(request, (result.first_token_id, result.first_logprob), result.kv)
    async with aclosing(stream):
        async for delta in stream:
            tokens += delta.token_ids
            timing = delta.finished or timing
    return tokens, result, timing


@pytest.mark.parametrize("transport", ["store", "direct", "shm", "recompute"])
def test_each_transport_gives_the_engine_alone_tokens(
    tiny_llama_dir: Path, reference: list[list[int]], transport: str
) -> None:
    async def body() -> None:
        async with pair(tiny_llama_dir, TransferOptions()) as p:
            outs = await asyncio.gather(
                *(
                    hand_off(p, f"{transport}-{i}", prompt, transport)
                    for i, prompt in enumerate(prompts(0, LENGTHS))
                )
            )
            layout = p.engines[0].layout
            for (tokens, result, timing), ref, n in zip(outs, reference, LENGTHS, strict=True):
                assert tokens == ref
                assert result.kv is not None and result.kv.kind.value == transport
                sent, got = result.transfer, timing.transfer  # type: ignore[attr-defined]
                assert sent is not None and got is not None
                assert got.transport == transport
                if transport == "recompute":
                    assert result.timing.transfer_bytes == 0 and got.num_bytes == 0
                    assert got.fallback_reason == "recompute was asked for"
                    continue
                assert not got.fallback_reason
                # KV bytes from the model's shape, independently of the transport's framing.
                kv = n * layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * 4
                assert kv <= sent.num_bytes < kv + 4096
                assert got.num_bytes == sent.num_bytes == result.timing.transfer_bytes
                # Measured on both sides, in order.
                assert sent.send_start_ns <= sent.first_layer_ns <= sent.last_layer_ns
                assert sent.last_layer_ns <= sent.compute_end_ns <= sent.send_end_ns
                assert 0 < got.recv_start_ns < got.recv_end_ns
                assert sent.overlap_ms + sent.exposed_ms == pytest.approx(sent.send_ms, abs=1e-3)

    run(body)


def test_int8_compression_moves_about_half_the_bytes(tiny_llama_dir: Path) -> None:
    async def body() -> None:
        options = TransferOptions(compression=Compression.INT8)
        async with pair(tiny_llama_dir, options) as p:
            prompt = prompts(1, [64])[0]
            tokens, result, timing = await hand_off(p, "int8", prompt, "store")
            assert len(tokens) == GREEDY.max_tokens
            layout = p.engines[0].layout
            t, h, d = 64, layout.num_kv_heads, layout.head_dim
            per_part = t * h * d + (t // 16) * h * 4  # int8 values + fp32 scale per 16 tokens
            frames = layout.num_layers * 2 * per_part
            assert result.transfer is not None and result.transfer.compression == "int8"
            assert frames <= result.timing.transfer_bytes < frames + 4096
            assert timing.transfer.compression == "int8"  # type: ignore[attr-defined]

    run(body)


@pytest.mark.parametrize("transport", ["store", "direct"])
def test_a_corrupted_frame_is_caught_and_recomputed(
    tiny_llama_dir: Path, reference: list[list[int]], transport: str
) -> None:
    async def body() -> None:
        options = TransferOptions(faults=SendFaults(corrupt_prefix="bad-"))
        async with pair(tiny_llama_dir, options) as p:
            prompt = prompts(0, LENGTHS)[1]
            tokens, result, timing = await hand_off(p, "bad-1", prompt, transport)
            assert tokens == reference[1]
            got = timing.transfer  # type: ignore[attr-defined]
            assert got.transport == "recompute" and "checksum" in got.fallback_reason
            assert result.kv is not None
            if transport == "store":  # the store keeps what it got; the reader notices
                assert result.kv.kind.value == transport
            else:  # the decode worker checks frames as they land: the Push fails at once
                assert result.kv.kind is TransportKind.RECOMPUTE
            tokens, _, timing = await hand_off(p, "good-1", prompt, transport)
            assert tokens == reference[1] and timing.transfer.transport == transport  # type: ignore[attr-defined]

    run(body)


@pytest.mark.parametrize("transport", ["store", "direct", "shm"])
def test_a_stalled_hand_off_times_out_into_recompute(
    tiny_llama_dir: Path, reference: list[list[int]], transport: str
) -> None:
    async def body() -> None:
        options = TransferOptions(faults=SendFaults(stall_prefix="slow-"), timeout_s=0.3)
        async with pair(tiny_llama_dir, options) as p:
            prompt = prompts(0, LENGTHS)[2]
            tokens, result, timing = await hand_off(p, "slow-1", prompt, transport)
            assert tokens == reference[2]
            assert result.kv is not None and result.kv.kind is TransportKind.RECOMPUTE
            assert result.transfer is not None and "within 0.3 s" in result.transfer.fallback_reason
            assert timing.transfer.transport == "recompute"  # type: ignore[attr-defined]
            for _ in range(100):  # the cut-off stream reaches the store's servicer a bit later
                if p.store.stats().num_writing == p.inbox.stats().num_writing == 0:
                    break
                await asyncio.sleep(0.02)

    run(body)


def test_an_unreachable_store_ends_in_recompute(
    tiny_llama_dir: Path, reference: list[list[int]]
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"

    async def body() -> None:
        async with pair(tiny_llama_dir, TransferOptions(), store_address=dead) as p:
            prompt = prompts(0, LENGTHS)[0]
            tokens, result, timing = await hand_off(p, "nostore", prompt, "store")
            assert tokens == reference[0]
            assert result.kv is not None and result.kv.kind is TransportKind.RECOMPUTE
            assert timing.transfer.transport == "recompute"  # type: ignore[attr-defined]

    run(body)


def test_layerwise_overlaps_and_deferred_does_not(tiny_llama_dir: Path) -> None:
    """Layer-wise, the layers leave before the compute ends; deferred, all after it."""

    async def body() -> None:
        prompt = prompts(2, [200])[0]
        for layerwise in (True, False):
            async with pair(tiny_llama_dir, TransferOptions(layerwise=layerwise)) as p:
                for transport in ("store", "shm"):
                    _, result, _ = await hand_off(
                        p, f"o-{transport}-{layerwise}", prompt, transport
                    )
                    sent = result.transfer
                    assert sent is not None and sent.layerwise is layerwise
                    if layerwise:
                        assert sent.first_layer_ns < sent.compute_end_ns
                        assert sent.overlap_ms > 0
                    else:
                        assert sent.first_layer_ns >= sent.compute_end_ns
                        assert sent.overlap_ms == 0 and sent.exposed_ms > 0

    run(body)


def test_a_cancelled_prefill_leaves_nothing(tiny_llama_dir: Path) -> None:
    async def body() -> None:
        options = TransferOptions(
            faults=SendFaults(stall_prefix="", stall_after_layers=2), timeout_s=30
        )
        async with pair(tiny_llama_dir, options) as p:
            prompt = prompts(3, [50])[0]
            for transport in ("store", "direct", "shm"):
                task = asyncio.create_task(
                    p.prefill.prefill(
                        EngineRequest(f"cancel-{transport}", tuple(prompt), GREEDY),
                        HandoffRoute(p.inbox_address, HOST, transport),
                    )
                )
                target = p.store if transport == "store" else p.inbox
                for _ in range(500):  # until the stalled stream holds a reservation, or shm
                    if transport == "shm" or target.stats().num_writing:
                        break
                    await asyncio.sleep(0.01)
                if transport == "shm":
                    name = segment_name(f"cancel-{transport}")
                    for _ in range(500):
                        if (SHM_DIR / name).exists():
                            break
                        await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                for _ in range(100):
                    if target.stats().num_writing == 0:
                        break
                    await asyncio.sleep(0.02)

    run(body)


# -- frames, without engines -------------------------------------------------------------------
def _layer_tensors(layout: KVLayout, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, layout.num_kv_heads, layout.head_dim)
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for _ in range(layout.num_layers)
    ]


LAYOUT = KVLayout("fp", "float32", 3, 2, 8, 16)


@pytest.mark.parametrize("feeding", ["pieces with crcs", "one blob", "odd slices", "mixed"])
def test_frames_assemble_however_the_bytes_are_cut(
    feeding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sealed into chunk pieces (CRCs combined into each frame's), collected from the pieces
    with their CRCs, from one blob, from slices that straddle frames, or a mix: the same
    tensors, bit for bit."""
    n = 21
    layers = _layer_tensors(LAYOUT, n, 0)
    header = StreamHeader("r", LAYOUT, n)
    pieces = [
        p
        for i, (k, v) in enumerate(layers)
        for p in received(LayerCopy.take(i, k, v).seal(100, Compression.NONE))
    ]
    # No message for a frame header alone: it rides with the first 100 bytes of K.
    part = n * LAYOUT.num_kv_heads * LAYOUT.head_dim * 4
    assert len(pieces) == LAYOUT.num_layers * 2 * -(-part // 100)
    assert all(bytes(p[:4]) == b"PDLF" for p, _ in pieces[:: 2 * -(-part // 100)])
    blob = b"".join(p for p, _ in pieces)
    assert len(header.encode()) + len(blob) == stream_bytes(header)
    collector = FrameCollector(header, expected_layout=LAYOUT)
    if feeding == "pieces with crcs":
        hashed: list[int] = []

        def crc32(data: bytes | memoryview, value: int = 0) -> int:
            hashed.append(len(data))
            return zlib.crc32(data, value)

        monkeypatch.setattr(frames, "fast_crc32", crc32)
        for data, crc in pieces:
            collector.feed(data, crc)
        # Every frame's CRC came from its pieces': only the headers were hashed again.
        assert hashed and max(hashed) <= FRAME_HEAD.size
    elif feeding == "one blob":
        collector.feed(blob)
    elif feeding == "odd slices":
        for i in range(0, len(blob), 77):
            collector.feed(blob[i : i + 77])
    else:
        for j, (data, crc) in enumerate(pieces):
            collector.feed(data, crc if j % 3 else None)
    payload = collector.build()
    for i, (k, v) in enumerate(layers):
        assert np.array_equal(payload.keys[i], host_array(k))
        assert np.array_equal(payload.values[i], host_array(v))


def test_a_flipped_byte_fails_the_frame_check_whichever_crcs_came_along() -> None:
    n = 5
    header = StreamHeader("r", LAYOUT, n)
    (k, v), *_ = _layer_tensors(LAYOUT, n, 1)
    for with_crcs in (True, False):
        pieces = received(LayerCopy.take(0, k, v).seal(64, Compression.NONE, corrupt=True))
        assert all(zlib.crc32(p) == c for p, c in pieces)  # each chunk itself looks fine
        collector = FrameCollector(header)
        with pytest.raises(KVTransferError, match="checksum"):
            for data, crc in pieces:
                collector.feed(data, crc if with_crcs else None)


def test_direct_hand_offs_are_assembled_as_they_land(tiny_llama_dir: Path) -> None:
    """By the time the prefill answers, the decode worker holds the pushed hand-off as a
    checked, assembled payload; the decode then only takes it."""

    async def body() -> None:
        async with pair(tiny_llama_dir, TransferOptions()) as p:
            prompt = prompts(4, [45])[0]
            request = EngineRequest("landed", tuple(prompt), GREEDY)
            route = HandoffRoute(p.inbox_address, transport="direct")
            result = await p.prefill.prefill(request, route)
            assert result.kv is not None and result.kv.kind is TransportKind.DIRECT
            stats = p.inbox.stats()
            assert (stats.num_entries, stats.num_writing) == (1, 0)
            assert stats.used_bytes == result.timing.transfer_bytes
            first = (result.first_token_id, result.first_logprob)
            stream = p.decode.decode(request, first, result.kv)
            async with aclosing(stream):
                async for delta in stream:
                    final = delta.finished
            assert final is not None and final.transfer is not None
            assert final.transfer.transport == "direct" and not final.transfer.fallback_reason
            assert final.transfer.num_bytes == result.timing.transfer_bytes

    run(body)


def test_a_direct_hand_off_discarded_after_its_last_layer_is_dropped_at_the_decode_worker(
    tiny_llama_dir: Path,
) -> None:
    """A request that ends at its first token discards its pushed hand-off: the sender's
    ``discard`` drops it at the decode worker (``Decode.Drop``) instead of leaving it there
    for its lease."""

    async def body() -> None:
        async with pair(tiny_llama_dir, TransferOptions()) as p:
            prompt = prompts(5, [30])[0]
            one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            result = await p.prefill.prefill(
                EngineRequest("one-token", tuple(prompt), one),
                HandoffRoute(p.inbox_address, transport="direct"),
            )
            assert result.kv is None or result.kv.kind is not TransportKind.DIRECT
            # pair() checks on exit that the inbox holds nothing.

    run(body)


async def _store_and_client(stack: AsyncExitStack) -> tuple[KVStore, KVStoreClient]:
    """A KV store served on a free port and a client of it, both closed with ``stack``."""
    store = KVStore(64 * 1024**2)
    address = await _serve(stack, KVStoreServicer(store))
    client = KVStoreClient(address, timeout_s=5)
    stack.push_async_callback(client.close)
    return store, client


class _CountingSealer(ThreadPoolExecutor):
    """One sealing thread that counts what it was given."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize("inline", [True, False])
def test_large_layers_are_sealed_as_they_are_taken_small_ones_by_the_loop(
    inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large frame goes to the sealing thread from the layer hook itself: every seal is
    under way before the event loop runs once more. A small one is left to the loop, which
    seals it as it sends it: the thread gets nothing. Either way the stream carries the layers
    intact."""
    n = 11
    if not inline:
        size = frame_bytes(LAYOUT, n, Compression.NONE)
        monkeypatch.setattr(stream_sender, "INLINE_SEAL_BYTES", size - 1)

    async def body() -> None:
        async with AsyncExitStack() as stack:
            store, client = await _store_and_client(stack)
            sealer = stack.enter_context(_CountingSealer())
            layers = _layer_tensors(LAYOUT, n, 4)
            sender = StreamSender(client, TransportKind.STORE, lease_s=30, sealer=sealer)
            sender.begin("r-sealed", LAYOUT, n)
            for i, (k, v) in enumerate(layers):
                sender.send_layer(i, k, v)
            # No await since the first layer.
            assert sealer.submitted == (0 if inline else LAYOUT.num_layers)
            descriptor = await sender.commit(5.0)
            assert sealer.submitted == (0 if inline else LAYOUT.num_layers)
            collector: FrameCollector | None = None
            async for chunk in client.stream(descriptor.key, delete_after_read=True):
                collector = collector or FrameCollector(StreamHeader.decode(chunk.header))
                collector.feed(chunk.data, chunk.crc32)
            assert collector is not None
            payload = collector.build()
            for i, (k, v) in enumerate(layers):
                assert np.array_equal(payload.keys[i], host_array(k))
                assert np.array_equal(payload.values[i], host_array(v))
            assert store.stats().num_entries == 0

    run(body)


@pytest.mark.parametrize("await_the_store", [True, False])
def test_discarding_a_whole_stream_never_committed_leaves_no_entry(await_the_store: bool) -> None:
    """A request that ends at its first token discards its hand-off without a commit. Its
    last layer already ended the stream, so the endpoint holds (or is about to hold) the
    whole entry: discard deletes it, whether or not the store had acknowledged it yet."""

    async def body() -> None:
        async with AsyncExitStack() as stack:
            store, client = await _store_and_client(stack)
            n = 7
            sealer = stack.enter_context(ThreadPoolExecutor(1))
            sender = StreamSender(client, TransportKind.STORE, lease_s=30, sealer=sealer)
            sender.begin("r-dropped", LAYOUT, n)
            for i, (k, v) in enumerate(_layer_tensors(LAYOUT, n, 5)):
                sender.send_layer(i, k, v)
            task = sender._task
            assert task is not None
            if await_the_store:
                await asyncio.wait_for(asyncio.shield(task), 30)
                assert store.stats().num_entries == 1
            await sender.discard()
            await sender.discard()  # idempotent
            stats = store.stats()
            assert (stats.num_entries, stats.num_writing, stats.used_bytes) == (0, 0, 0)

    run(body)


def test_the_last_layer_ends_the_stream_before_the_commit() -> None:
    """The store holds the whole hand-off once the last layer is taken: the acknowledgement
    does not wait for the prefill's ``commit``, which then only collects it."""

    async def body() -> None:
        async with AsyncExitStack() as stack:
            store, client = await _store_and_client(stack)
            n = 13
            layers = _layer_tensors(LAYOUT, n, 2)
            sealer = stack.enter_context(ThreadPoolExecutor(1))
            sender = StreamSender(client, TransportKind.STORE, lease_s=30, sealer=sealer)
            sender.begin("r-early", LAYOUT, n)
            for i, (k, v) in enumerate(layers):
                assert store.stats().num_entries == 0
                sender.send_layer(i, k, v)
            task = sender._task
            assert task is not None
            await asyncio.wait_for(asyncio.shield(task), 30)  # no commit called yet
            assert store.stats().num_entries == 1 and store.stats().num_writing == 0
            descriptor = await sender.commit(5.0)
            assert descriptor.num_bytes == stream_bytes(StreamHeader("r-early", LAYOUT, n))
            await sender.discard()  # deletes the committed entry
            assert store.stats().num_entries == 0

    run(body)
