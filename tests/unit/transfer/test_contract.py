"""The KVSender/KVReceiver contract, checked against every implementation here (fake, shm)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.errors import KVPayloadMismatchError, KVTransferError
from pdserve.transfer.base import KVReceiver, KVSender, TransferDescriptor, TransferState
from pdserve.transfer.fake import FakeHub, FakeReceiver, FakeSender
from pdserve.transfer.shm import ShmReceiver, ShmSender
from tests.unit.transfer.conftest import assert_same_payload, leftovers, make_layout, random_payload


@dataclass
class Pair:
    """Makes senders and receivers of one implementation; ``leftovers`` lists what remains."""

    sender: Callable[[], KVSender]
    receiver: Callable[[KVLayout | None], KVReceiver]
    leftovers: Callable[[], list[str]]


@pytest.fixture(params=["fake", "shm"])
def pair(request: pytest.FixtureRequest, shm_prefix: str) -> Pair:
    if request.param == "fake":
        hub = FakeHub()
        return Pair(
            lambda: FakeSender(hub), lambda lay: FakeReceiver(hub, expected_layout=lay), hub.keys
        )
    return Pair(
        lambda: ShmSender(prefix=shm_prefix),
        lambda lay: ShmReceiver(expected_layout=lay),
        lambda: leftovers(shm_prefix),
    )


def send(
    sender: KVSender, rid: str, payload: KVPayload, order: list[int] | None = None
) -> TransferDescriptor:
    sender.begin(rid, payload.layout, payload.num_tokens)
    for i in order if order is not None else range(payload.layout.num_layers):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    return sender.finish()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_any_layer_order(pair: Pair, dtype: str) -> None:
    layout = make_layout(dtype, num_layers=4)
    payload = random_payload(layout, 37)
    order = list(range(4))
    random.Random(3).shuffle(order)
    sender = pair.sender()
    assert sender.state is TransferState.PENDING
    desc = send(sender, "req-1", payload, order)
    assert sender.state is TransferState.SENT
    assert desc.request_id == "req-1" and desc.num_tokens == 37
    assert desc.model_fingerprint == layout.model_fingerprint and len(desc.layer_checksums) == 4
    receiver = pair.receiver(layout)
    got = asyncio.run(receiver.receive(desc, timeout_s=5.0))
    assert receiver.state is TransferState.DONE
    assert_same_payload(got, payload)
    assert pair.leftovers() == []  # the receiver released the transport's copy
    s = sender.stats.merged(receiver.stats)
    assert s.num_bytes >= payload.nbytes
    assert s.send_start_ns <= s.first_layer_ns <= s.last_layer_ns <= s.send_end_ns
    assert s.recv_start_ns <= s.recv_end_ns and s.hook_ns > 0


def test_hook_views_may_change_after_the_call(pair: Pair) -> None:
    # The engine's hook tensors are valid only during the call: the sender must copy.
    payload = random_payload(make_layout(), 9)
    sender = pair.sender()
    sender.begin("r", payload.layout, 9)
    for i in range(payload.layout.num_layers):
        k, v = payload.keys[i].clone(), payload.values[i].clone()
        sender.send_layer(i, k, v)
        k.zero_()
        v.zero_()
    got = asyncio.run(pair.receiver(None).receive(sender.finish(), timeout_s=5.0))
    assert_same_payload(got, payload)


def test_missing_layer_fails_finish_and_frees(pair: Pair) -> None:
    payload = random_payload(make_layout(num_layers=3), 5)
    sender = pair.sender()
    with pytest.raises(KVTransferError, match=r"\[1\]"):
        send(sender, "r", payload, order=[0, 2])
    assert sender.state is TransferState.FAILED
    assert pair.leftovers() == []


def test_bad_layer_in_hook_never_raises_into_the_engine(pair: Pair) -> None:
    payload = random_payload(make_layout(num_layers=2), 5)
    sender = pair.sender()
    sender.begin("r", payload.layout, 5)
    sender.send_layer(0, payload.keys[0][:3], payload.values[0][:3])  # wrong token count
    sender.send_layer(1, payload.keys[1], payload.values[1])
    with pytest.raises(KVTransferError):
        sender.finish()
    assert sender.state is TransferState.FAILED and pair.leftovers() == []


def test_abort_frees_and_is_idempotent(pair: Pair) -> None:
    payload = random_payload(make_layout(), 5)
    sender = pair.sender()
    sender.begin("r", payload.layout, 5)
    sender.send_layer(0, payload.keys[0], payload.values[0])
    assert pair.leftovers() != []
    sender.abort()
    sender.abort()
    assert sender.state is TransferState.FAILED and pair.leftovers() == []
    with pytest.raises(KVTransferError):
        sender.finish()


def test_abort_after_finish_revokes(pair: Pair) -> None:
    sender = pair.sender()
    desc = send(sender, "r", random_payload(make_layout(), 5))
    sender.abort()
    assert pair.leftovers() == []
    receiver = pair.receiver(None)
    with pytest.raises(KVTransferError):
        asyncio.run(receiver.receive(desc, timeout_s=0.5))
    assert receiver.state is TransferState.FAILED


def test_layout_mismatch_refused_and_freed(pair: Pair) -> None:
    payload = random_payload(make_layout("float32"), 5)
    desc = send(pair.sender(), "r", payload)
    receiver = pair.receiver(make_layout("bfloat16"))
    with pytest.raises(KVPayloadMismatchError, match="dtype"):
        asyncio.run(receiver.receive(desc, timeout_s=5.0))
    receiver.cleanup()
    assert receiver.state is TransferState.FAILED and pair.leftovers() == []


def test_a_receiver_is_single_use(pair: Pair) -> None:
    payload = random_payload(make_layout(), 5)
    receiver = pair.receiver(None)
    asyncio.run(receiver.receive(send(pair.sender(), "a", payload), timeout_s=5.0))
    with pytest.raises(KVTransferError, match="DONE"):
        asyncio.run(receiver.receive(send(pair.sender(), "b", payload), timeout_s=5.0))
    receiver.cleanup()


def test_two_hand_offs_at_once(pair: Pair) -> None:
    a, b = random_payload(make_layout(), 5, seed=1), random_payload(make_layout(), 8, seed=2)
    da, db = send(pair.sender(), "a", a), send(pair.sender(), "b", b)

    async def both() -> list[KVPayload]:
        return list(
            await asyncio.gather(
                pair.receiver(None).receive(db, timeout_s=5.0),
                pair.receiver(None).receive(da, timeout_s=5.0),
            )
        )

    got_b, got_a = asyncio.run(both())
    assert_same_payload(got_a, a)
    assert_same_payload(got_b, b)
    assert pair.leftovers() == []
