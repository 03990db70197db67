"""The state machine, stats and registry of base.py."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidArgumentError, KVTransferError
from pdserve.transfer.base import (
    TransferState,
    TransferStats,
    Transport,
    TransportKind,
    TransportRegistry,
    advance,
    default_registry,
)
from pdserve.transfer.fake import FakeHub, FakeReceiver, FakeSender
from pdserve.transfer.shm import ShmReceiver, ShmSender


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


def test_stats_derived_values() -> None:
    ms = 1_000_000
    send = TransferStats(
        TransportKind.SHM,
        num_bytes=4000,
        send_start_ns=10 * ms,
        send_end_ns=30 * ms,
        first_layer_ns=12 * ms,
        last_layer_ns=20 * ms,
        hook_ns=2 * ms,
    )
    assert send.send_ms == 20.0 and send.overlap_ms == 8.0 and send.recv_ms == 0.0
    assert send.bytes_per_s == pytest.approx(4000 / 0.002)
    recv = TransferStats(TransportKind.SHM, recv_start_ns=40 * ms, recv_end_ns=44 * ms)
    both = send.merged(recv)
    assert both.recv_ms == 4.0 and both.send_ms == 20.0 and both.num_bytes == 4000
    assert both.bytes_per_s == pytest.approx(4000 / 0.004)  # the slower side bounds it
    assert TransferStats(TransportKind.STORE).bytes_per_s == 0.0
    assert TransferStats(TransportKind.STORE).overlap_ms == 0.0


def test_registry() -> None:
    hub = FakeHub()
    registry = TransportRegistry()
    registry.register(
        TransportKind.DIRECT, Transport(lambda: FakeSender(hub), lambda: FakeReceiver(hub))
    )
    assert isinstance(registry.get(TransportKind.DIRECT).sender(), FakeSender)
    with pytest.raises(InvalidArgumentError, match="already registered"):
        registry.register(TransportKind.DIRECT, registry.get(TransportKind.DIRECT))
    with pytest.raises(InvalidArgumentError, match="recompute"):
        registry.register(TransportKind.RECOMPUTE, registry.get(TransportKind.DIRECT))
    with pytest.raises(InvalidArgumentError) as err:
        registry.get(TransportKind.STORE)
    assert err.value.field == "transport"


def test_default_registry_has_shm() -> None:
    registry = default_registry(host="h1")
    shm = registry.get(TransportKind.SHM)
    sender, receiver = shm.sender(), shm.receiver()
    assert isinstance(sender, ShmSender) and isinstance(receiver, ShmReceiver)
    assert sender.host == receiver.host == "h1"
    assert sender is not shm.sender()  # one per hand-off
