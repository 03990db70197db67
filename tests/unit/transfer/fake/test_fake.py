"""The fake transport's fault injection (``SendFaults``): every fault ends as a typed error
on the receiver, or the sender's commit, through the real frame checks."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.errors import KVTransferError
from pdserve.transfer.base import TransferState
from pdserve.transfer.compress import Compression
from pdserve.transfer.fake import FakeHub, FakeReceiver, FakeSender
from pdserve.transfer.faults import SendFaults
from tests.unit.transfer.conftest import make_layout, random_payload


@pytest.mark.parametrize(
    ("faults", "match"),
    [
        (SendFaults(drop_prefix="", drop_layers=frozenset({2})), r"\[2\] never arrived"),
        (SendFaults(drop_prefix="r", drop_layers=frozenset({0, 3})), r"\[0, 3\] never arrived"),
        (SendFaults(corrupt_prefix=""), "layer 0 failed its checksum"),
    ],
)
def test_faults_surface_as_transfer_errors(faults: SendFaults, match: str) -> None:
    hub = FakeHub()
    payload = random_payload(make_layout(num_layers=4), 6)
    sender = FakeSender(hub, faults=faults)

    async def main() -> None:
        sender.begin("r", payload.layout, 6)
        for i in range(4):
            sender.send_layer(i, payload.keys[i], payload.values[i])
        receiver = FakeReceiver(hub, await sender.commit(5.0))
        with pytest.raises(KVTransferError, match=match):
            await receiver.receive(5.0)
        assert receiver.state is TransferState.FAILED

    asyncio.run(main())
    assert hub.keys() == []  # a failed receive releases the stream too


def test_a_fault_spares_the_requests_it_does_not_name() -> None:
    hub = FakeHub()
    payload = random_payload(make_layout(num_layers=2), 6)
    faults = SendFaults(corrupt_prefix="bad-", drop_prefix="bad-", drop_layers=frozenset({0}))

    async def main() -> None:
        sender = FakeSender(hub, faults=faults)
        sender.begin("good", payload.layout, 6)
        for i in range(2):
            sender.send_layer(i, payload.keys[i], payload.values[i])
        got = await FakeReceiver(hub, await sender.commit(5.0)).receive(5.0)
        assert got.num_tokens == 6

    asyncio.run(main())


def test_a_stall_times_out_the_commit_and_the_receiver() -> None:
    hub = FakeHub()
    payload = random_payload(make_layout(num_layers=3), 6)
    sender = FakeSender(hub, faults=SendFaults(stall_prefix="", stall_after_layers=1))

    async def main() -> None:
        sender.begin("r", payload.layout, 6)
        receiver = FakeReceiver(hub, sender.planned())
        waiting = asyncio.create_task(receiver.receive(0.05))
        for i in range(3):
            sender.send_layer(i, payload.keys[i], payload.values[i])
        with pytest.raises(KVTransferError, match="not committed within"):
            await sender.commit(0.05)
        with pytest.raises(KVTransferError, match="not sealed within"):
            await waiting
        await sender.discard()

    asyncio.run(main())
    assert hub.keys() == []


def test_receiver_may_wait_before_the_sender_commits() -> None:
    # A streaming receiver starts waiting as soon as it knows the location; the layers
    # arrive from another thread (the engine's), then the commit.
    hub = FakeHub()
    payload = random_payload(make_layout(num_layers=3), 6)
    sender = FakeSender(hub, compression=Compression.INT8)

    async def main() -> None:
        sender.begin("r", payload.layout, 6)
        receiver = FakeReceiver(hub, sender.planned(), expected_layout=payload.layout)
        waiting = asyncio.create_task(receiver.receive(5.0))

        def engine_thread() -> None:
            for i in range(3):
                sender.send_layer(i, payload.keys[i], payload.values[i])

        await asyncio.to_thread(engine_thread)
        await sender.commit(5.0)
        got = await waiting
        assert got.num_tokens == 6 and receiver.state is TransferState.DONE
        assert receiver.compression == "int8"

    asyncio.run(main())
