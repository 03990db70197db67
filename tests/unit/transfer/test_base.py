"""The state machine, the record and the registries of the transfer interface."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.errors import InvalidArgumentError, KVTransferError
from pdserve.transfer.base import (
    HandoffRecord,
    KVLocation,
    TransferState,
    Transport,
    TransportKind,
    advance,
)
from pdserve.transfer.fake import FakeHub, FakeReceiver, FakeSender, fake_transports


def test_terminal_states_are_the_top_of_the_order() -> None:
    terminal = {s for s in TransferState if s >= TransferState.DONE}
    assert terminal == {TransferState.DONE, TransferState.FAILED}
    assert all(s.terminal == (s in terminal) for s in TransferState)


@pytest.mark.parametrize(
    "path",
    [
        [TransferState.SENDING, TransferState.SENT],
        [TransferState.SENDING, TransferState.FAILED],
        [TransferState.SENDING, TransferState.SENT, TransferState.FAILED],
        [TransferState.RECEIVING, TransferState.DONE],
        [TransferState.RECEIVING, TransferState.FAILED],
        [TransferState.FAILED],
    ],
)
def test_legal_paths(path: list[TransferState]) -> None:
    state = TransferState.PENDING
    for nxt in path:
        state = advance(state, nxt)
    assert state is path[-1]


@pytest.mark.parametrize(
    ("current", "new"),
    [
        (TransferState.PENDING, TransferState.SENT),  # finish without begin
        (TransferState.PENDING, TransferState.DONE),
        (TransferState.SENT, TransferState.SENDING),
        (TransferState.DONE, TransferState.FAILED),  # terminal stays terminal
        (TransferState.FAILED, TransferState.PENDING),
        (TransferState.RECEIVING, TransferState.SENT),
    ],
)
def test_illegal_moves(current: TransferState, new: TransferState) -> None:
    with pytest.raises(KVTransferError, match=f"{current.name} to {new.name}"):
        advance(current, new)


def test_record_derived_values() -> None:
    ms = 1_000_000
    sent = HandoffRecord(
        TransportKind.SHM.value,
        num_bytes=4000,
        send_start_ns=10 * ms,
        first_layer_ns=12 * ms,
        last_layer_ns=20 * ms,
        compute_end_ns=22 * ms,
        send_end_ns=30 * ms,
        hook_ns=2 * ms,
        busy_ns=4 * ms,
    )
    assert sent.transfer_start_ns == 12 * ms and sent.send_ms == 18.0
    assert sent.overlap_ms == 10.0  # first layer to the end of the compute
    assert sent.exposed_ms == 8.0  # end of the compute to the commit
    assert sent.recv_ms == 0.0 and sent.bytes_per_s == pytest.approx(4000 / 0.004)
    got = HandoffRecord(
        TransportKind.SHM.value, num_bytes=4000, recv_start_ns=40 * ms, recv_end_ns=44 * ms
    )
    assert got.recv_ms == 4.0 and got.bytes_per_s == pytest.approx(4000 / 0.004)
    assert got.received().wait_ms == 4.0 and not got.received().prefetched
    tail = got.received(compression="int8", wait_ms=1.5)
    assert (tail.wait_ms, tail.prefetched, tail.compression) == (1.5, True, "int8")
    empty = HandoffRecord(TransportKind.STORE.value)
    assert empty.bytes_per_s == empty.overlap_ms == empty.exposed_ms == empty.send_ms == 0.0
    assert sent.replace(fallback_reason="x").fallback_reason == "x" and not sent.fallback_reason


def test_registry() -> None:
    registry = fake_transports(FakeHub(), kinds=(TransportKind.DIRECT,))
    sender = registry.sender(TransportKind.DIRECT, "peer:1")
    assert isinstance(sender, FakeSender) and sender.kind is TransportKind.DIRECT
    location = KVLocation(TransportKind.DIRECT, "r", 1, 0, "fp", key="k")
    assert isinstance(registry.receiver(location), FakeReceiver)
    with pytest.raises(InvalidArgumentError, match="already registered"):
        registry.register(TransportKind.DIRECT, registry.get(TransportKind.DIRECT))
    with pytest.raises(InvalidArgumentError, match="recompute"):
        registry.register(TransportKind.RECOMPUTE, registry.get(TransportKind.DIRECT))
    with pytest.raises(InvalidArgumentError) as err:
        registry.get(TransportKind.STORE)
    assert err.value.field == "transport"
    registry.register(TransportKind.SHM, Transport(sender=lambda peer_address: sender))
    with pytest.raises(InvalidArgumentError, match="receives nothing"):
        registry.receiver(dataclasses.replace(location, kind=TransportKind.SHM))
