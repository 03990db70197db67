"""The fake transport's fault injection: every fault ends as a typed error on the receiver."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.errors import KVTransferError
from pdserve.transfer.base import TransferDescriptor, TransferState, TransportKind
from pdserve.transfer.compress import Compression
from pdserve.transfer.fake import FakeHub, FakeReceiver, FakeSender, Faults
from tests.unit.transfer.conftest import make_layout, random_payload


@pytest.mark.parametrize(
    ("faults", "match"),
    [
        (Faults(drop_layers=frozenset({2})), r"\[2\] never arrived"),
        (Faults(drop_layers=frozenset({0, 3})), r"\[0, 3\] never arrived"),
        (Faults(corrupt_layers=frozenset({1})), "layer 1"),
        (Faults(stall=True), "not sealed within"),
    ],
)
def test_faults_surface_as_transfer_errors(faults: Faults, match: str) -> None:
    hub = FakeHub()
    payload = random_payload(make_layout(num_layers=4), 6)
    sender = FakeSender(hub, faults=faults)
    sender.begin("r", payload.layout, 6)
    for i in range(4):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    desc = sender.finish()
    receiver = FakeReceiver(hub)
    # A stall is detected by the timeout; keep it short, nothing else waits on it.
    with pytest.raises(KVTransferError, match=match):
        asyncio.run(receiver.receive(desc, timeout_s=0.05))
    assert receiver.state is TransferState.FAILED
    assert hub.keys() == []  # a failed receive releases the stream too


def test_receiver_may_wait_before_the_sender_finishes() -> None:
    # A streaming receiver starts waiting as soon as it has the descriptor's name; the layers
    # arrive from another thread (the engine's), then the seal.
    hub = FakeHub()
    payload = random_payload(make_layout(num_layers=3), 6)
    sender = FakeSender(hub, compression=Compression.INT8)

    async def main() -> None:
        sender.begin("r", payload.layout, 6)
        receiver = FakeReceiver(hub, expected_layout=payload.layout)
        # What the decode side knows before the prefill finishes: the name and the size.
        descriptor_now = TransferDescriptor(TransportKind.DIRECT, "r", 6, 0, "fp-a", name="r")
        waiting = asyncio.create_task(receiver.receive(descriptor_now, timeout_s=5.0))

        def engine_thread() -> None:
            for i in range(3):
                sender.send_layer(i, payload.keys[i], payload.values[i])
            sender.finish()

        await asyncio.to_thread(engine_thread)
        got = await waiting
        assert got.num_tokens == 6 and receiver.state is TransferState.DONE

    asyncio.run(main())
