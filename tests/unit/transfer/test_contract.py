"""The KVSender/KVReceiver contract (``transfer.base``), checked against every backend:
``fake`` (in memory, on the real frames), ``shm`` (a segment on this host), ``stream``
(``store``: the layer stream into a real KVStore servicer on loopback gRPC), ``direct`` (the
same stream pushed into a real Decode servicer's inbox on loopback gRPC) and ``mooncake`` (the
``store`` layer stream into a real Mooncake Store: a ``mooncake_master`` and two clients, the
writer's lending the segment; skipped where the package cannot load)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from pdserve.engine.kv_payload import KVLayout, KVPayload, kv_fingerprint
from pdserve.errors import KVPayloadMismatchError, KVTransferError, UnknownRequestError
from pdserve.kvstore.client import KVStoreClient
from pdserve.kvstore.mooncake import library as mooncake_library
from pdserve.kvstore.mooncake.client import MooncakeStoreClient
from pdserve.kvstore.mooncake.master import MasterProcess
from pdserve.kvstore.store import KVStore
from pdserve.kvstore.wire import add_kvstore_servicer
from pdserve.rpc.server import build_server
from pdserve.transfer.base import KVLocation, KVReceiver, KVSender, TransferState, TransportKind
from pdserve.transfer.fake import FakeHub, FakeReceiver, FakeSender
from pdserve.transfer.nixl.agent import nixl_available
from pdserve.transfer.nixl.receiver import NixlReceiver
from pdserve.transfer.nixl.sender import NixlSender
from pdserve.transfer.shm.handoff import ShmReceiver, ShmSender
from pdserve.transfer.shm.reader import SegmentReader
from pdserve.transfer.shm.writer import SegmentWriter
from pdserve.transfer.stream.inbox import Inbox
from pdserve.transfer.stream.push import PushClient
from pdserve.transfer.stream.receiver import LocalReceiver, StreamReceiver
from pdserve.transfer.stream.sender import StreamSender
from services.decode.servicer import DecodeServicer, add_decode_servicer
from services.kvstore.servicer import KVStoreServicer
from tests.unit.transfer.conftest import assert_same_payload, leftovers, make_layout, random_payload
from tests.unit.transfer.nixl.pair import nixl_leftovers, nixl_pair

NIXL = pytest.param(
    "nixl",
    marks=pytest.mark.skipif(
        not nixl_available(), reason="NIXL is not installed (the pdserve[nixl] extra)"
    ),
)
BACKENDS = ["fake", "shm", "stream", "direct", NIXL, "mooncake"]


@dataclass
class Backend:
    """Makes senders and receivers of one backend; ``leftovers`` lists what remains of
    committed hand-offs (fake streams, shm segments, store entries)."""

    name: str
    sender: Callable[[], KVSender]
    receiver: Callable[[KVLocation, KVLayout | None], KVReceiver]
    leftovers: Callable[[], list[str]]


@asynccontextmanager
async def backend(name: str, shm_prefix: str) -> AsyncIterator[Backend]:
    if name == "fake":
        hub = FakeHub()
        yield Backend(
            name,
            lambda: FakeSender(hub),
            lambda loc, lay: FakeReceiver(hub, loc, expected_layout=lay),
            hub.keys,
        )
        return
    if name == "shm":
        yield Backend(
            name,
            lambda: ShmSender(SegmentWriter(prefix=shm_prefix)),
            lambda loc, lay: ShmReceiver(SegmentReader(expected_layout=lay), loc),
            lambda: leftovers(shm_prefix),
        )
        return
    if name == "nixl":
        with nixl_pair() as (pool, reader):
            yield Backend(
                name,
                lambda: NixlSender(pool),
                lambda loc, lay: NixlReceiver(reader, loc, expected_layout=lay),
                lambda: nixl_leftovers(pool, reader),
            )
        return
    if name == "direct":
        async with AsyncExitStack() as stack:
            inbox = Inbox(16 * 1024**2)
            worker = SimpleNamespace(connector=SimpleNamespace(inbox=inbox))
            servicer = DecodeServicer(worker)  # type: ignore[arg-type]
            server, port, _ = build_server([(add_decode_servicer, servicer)], port=0)
            await server.start()
            stack.push_async_callback(server.stop, None)
            push = PushClient(f"127.0.0.1:{port}", timeout_s=5)
            stack.push_async_callback(push.close)
            sealer = stack.enter_context(ThreadPoolExecutor(1))

            def pushed() -> list[str]:
                stats = inbox.stats()
                n = stats.num_entries + stats.num_writing
                return [f"{n} entries"] if n else []

            yield Backend(
                name,
                lambda: StreamSender(push, TransportKind.DIRECT, lease_s=30, sealer=sealer),
                lambda loc, lay: LocalReceiver(inbox, loc, expected_layout=lay),
                pushed,
            )
        return
    if name == "mooncake":
        reason = mooncake_library.available()
        if reason:
            pytest.skip(reason)
        async with AsyncExitStack() as stack:
            master = stack.enter_context(MasterProcess())
            writer = MooncakeStoreClient(master.address(segment="64MiB"), timeout_s=5)
            stack.push_async_callback(writer.close)
            reader = MooncakeStoreClient(
                master.address(segment=0), timeout_s=5, local_host="127.0.0.2"
            )
            stack.push_async_callback(reader.close)
            sealer = stack.enter_context(ThreadPoolExecutor(1))

            def objects() -> list[str]:
                n = master.key_count()
                return [f"{n} objects"] if n else []

            yield Backend(
                name,
                lambda: StreamSender(writer, TransportKind.STORE, lease_s=30, sealer=sealer),
                lambda loc, lay: StreamReceiver(reader, loc, expected_layout=lay),
                objects,
            )
        return
    async with AsyncExitStack() as stack:
        store = KVStore(16 * 1024**2)
        server, port, _ = build_server([(add_kvstore_servicer, KVStoreServicer(store))], port=0)
        await server.start()
        stack.push_async_callback(server.stop, None)
        client = KVStoreClient(f"127.0.0.1:{port}", timeout_s=5)
        stack.push_async_callback(client.close)
        sealer = stack.enter_context(ThreadPoolExecutor(1))

        def entries() -> list[str]:
            n = store.stats().num_entries
            return [f"{n} entries"] if n else []

        yield Backend(
            name,
            lambda: StreamSender(client, TransportKind.STORE, lease_s=30, sealer=sealer),
            lambda loc, lay: StreamReceiver(client, loc, expected_layout=lay),
            entries,
        )


def run(name: str, shm_prefix: str, body: Callable[[Backend], Awaitable[None]]) -> None:
    async def main() -> None:
        async with backend(name, shm_prefix) as b:
            await body(b)

    asyncio.run(asyncio.wait_for(main(), timeout=60))


async def send(
    sender: KVSender, rid: str, payload: KVPayload, order: list[int] | None = None
) -> KVLocation:
    sender.begin(rid, payload.layout, payload.num_tokens)
    for i in order if order is not None else range(payload.layout.num_layers):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    return await sender.commit(5.0)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_any_layer_order(name: str, dtype: str, shm_prefix: str) -> None:
    layout = make_layout(dtype, num_layers=4)
    payload = random_payload(layout, 37)
    order = list(range(4))
    random.Random(3).shuffle(order)

    async def body(b: Backend) -> None:
        sender = b.sender()
        assert sender.state is TransferState.PENDING
        loc = await send(sender, "req-1", payload, order)
        assert sender.state is TransferState.SENT
        assert loc == sender.planned() and loc.kind is sender.kind
        assert loc.request_id == "req-1" and loc.num_tokens == 37
        assert loc.model_fingerprint == kv_fingerprint(layout) and len(loc.capability) == 16
        receiver = b.receiver(loc, layout)
        got = await receiver.receive(5.0)
        assert receiver.state is TransferState.DONE
        assert_same_payload(got, payload)
        assert b.leftovers() == []  # the receiver released the transport's copy
        sent, received = sender.record, receiver.record
        assert sent.transport == received.transport == loc.kind.value
        assert sent.num_bytes >= payload.nbytes and received.num_bytes == sent.num_bytes
        assert sent.send_start_ns <= sent.first_layer_ns <= sent.last_layer_ns
        assert sent.last_layer_ns <= sent.send_end_ns and sent.hook_ns > 0
        assert 0 < received.recv_start_ns <= received.recv_end_ns
        await receiver.discard()  # a no-op after a read

    run(name, shm_prefix, body)


@pytest.mark.parametrize("name", ["fake", "shm", NIXL])
def test_hook_tensors_may_change_after_the_call(name: str, shm_prefix: str) -> None:
    # These senders copy during the call (nixl: into its registered blocks). (``stream``
    # keeps the engine's gathered copies, which nothing writes again: ``LayerHook``.)
    payload = random_payload(make_layout(), 9)

    async def body(b: Backend) -> None:
        sender = b.sender()
        sender.begin("r", payload.layout, 9)
        for i in range(payload.layout.num_layers):
            k, v = payload.keys[i].clone(), payload.values[i].clone()
            sender.send_layer(i, k, v)
            k.zero_()
            v.zero_()
        got = await b.receiver(await sender.commit(5.0), None).receive(5.0)
        assert_same_payload(got, payload)

    run(name, shm_prefix, body)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_missing_layer_fails_the_commit_and_discard_frees(name: str, shm_prefix: str) -> None:
    payload = random_payload(make_layout(num_layers=3), 5)

    async def body(b: Backend) -> None:
        sender = b.sender()
        with pytest.raises(KVTransferError, match=r"\[1\]"):
            await send(sender, "r", payload, order=[0, 2])
        await sender.discard()
        assert sender.state is TransferState.FAILED
        assert b.leftovers() == []

    run(name, shm_prefix, body)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_bad_layer_never_raises_into_the_engine(name: str, shm_prefix: str) -> None:
    payload = random_payload(make_layout(num_layers=2), 5)

    async def body(b: Backend) -> None:
        sender = b.sender()
        sender.begin("r", payload.layout, 5)
        sender.send_layer(0, payload.keys[0][:3], payload.values[0][:3])  # wrong token count
        sender.send_layer(1, payload.keys[1], payload.values[1])
        with pytest.raises(KVTransferError):
            await sender.commit(5.0)
        await sender.discard()
        assert sender.state is TransferState.FAILED and b.leftovers() == []

    run(name, shm_prefix, body)


@pytest.mark.parametrize("name", BACKENDS)
def test_discard_frees_and_is_idempotent(name: str, shm_prefix: str) -> None:
    payload = random_payload(make_layout(), 5)

    async def body(b: Backend) -> None:
        sender = b.sender()
        sender.begin("r", payload.layout, 5)
        sender.send_layer(0, payload.keys[0], payload.values[0])
        await sender.discard()
        await sender.discard()
        assert sender.state is TransferState.FAILED and b.leftovers() == []
        with pytest.raises(KVTransferError):
            await sender.commit(5.0)

    run(name, shm_prefix, body)


@pytest.mark.parametrize("name", BACKENDS)
def test_discard_after_commit_revokes(name: str, shm_prefix: str) -> None:
    async def body(b: Backend) -> None:
        sender = b.sender()
        loc = await send(sender, "r", random_payload(make_layout(), 5))
        await sender.discard()
        assert b.leftovers() == []
        receiver = b.receiver(loc, None)
        with pytest.raises((KVTransferError, UnknownRequestError)):
            await receiver.receive(0.5)
        assert receiver.state is TransferState.FAILED

    run(name, shm_prefix, body)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_layout_mismatch_is_refused_and_freed(name: str, shm_prefix: str) -> None:
    payload = random_payload(make_layout("float32"), 5)

    async def body(b: Backend) -> None:
        loc = await send(b.sender(), "r", payload)
        receiver = b.receiver(loc, make_layout("bfloat16"))
        with pytest.raises(KVPayloadMismatchError, match="dtype"):
            await receiver.receive(5.0)
        await receiver.discard()
        assert receiver.state is TransferState.FAILED and b.leftovers() == []

    run(name, shm_prefix, body)


@pytest.mark.parametrize("name", BACKENDS)
def test_a_receiver_is_single_use(name: str, shm_prefix: str) -> None:
    payload = random_payload(make_layout(), 5)

    async def body(b: Backend) -> None:
        receiver = b.receiver(await send(b.sender(), "a", payload), None)
        await receiver.receive(5.0)
        with pytest.raises(KVTransferError, match="DONE"):
            await receiver.receive(5.0)
        await receiver.discard()

    run(name, shm_prefix, body)


@pytest.mark.parametrize("name", BACKENDS)
def test_two_hand_offs_at_once(name: str, shm_prefix: str) -> None:
    a, b_ = random_payload(make_layout(), 5, seed=1), random_payload(make_layout(), 8, seed=2)

    async def body(b: Backend) -> None:
        la, lb = await send(b.sender(), "a", a), await send(b.sender(), "b", b_)
        got_b, got_a = await asyncio.gather(
            b.receiver(lb, None).receive(5.0), b.receiver(la, None).receive(5.0)
        )
        assert_same_payload(got_a, a)
        assert_same_payload(got_b, b_)
        assert b.leftovers() == []

    run(name, shm_prefix, body)
