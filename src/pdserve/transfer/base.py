"""The one interface of a KV hand-off: ``KVSender``, ``KVReceiver``, their states and the
``TransportRegistry`` the hand-off's connectors (``pdserve.handoff``) choose them from.

Lifecycle of one hand-off (one ``KVSender`` on the prefill worker, one ``KVReceiver`` on the
decode worker, both used once):

  1. Reserve (prefill): ``sender.begin(request_id, engine.layout, num_prompt_tokens)`` before
     the request is added; the transport reserves room for the header and every layer (an shm
     segment, a store entry, a stream). PENDING -> SENDING. ``sender.planned()`` then says
     where the data is going (the ``KVLocation`` that ``commit`` will return).
  2. Send (prefill): the engine runs the request with the layer hook ``sender.send_layer``;
     during the final prefill chunk the hook fires once per layer with that layer's
     ``[num_tokens, kv_heads, head_dim]`` K and V, and the transport writes them out while the
     later layers are still being computed. ``send_layer`` never raises into the engine (that
     would fail the whole batch): a failure is recorded and raised by ``commit``.
  3. Commit (prefill): after the first token, ``await sender.commit(timeout_s)`` checks every
     layer arrived, seals the data (waits, bounded, for the endpoint's acknowledgement) and
     returns the ``KVLocation`` (the ``KVHandle`` of the RPC). SENDING -> SENT. Ownership of
     the data passes to the receiver. On every other path ``await sender.discard()`` frees
     what ``begin`` reserved (-> FAILED); after SENT, ``discard`` revokes the hand-off.
  4. Receive (decode): a receiver made for the ``KVLocation`` (``TransportRegistry.receiver``);
     ``await receiver.receive(timeout_s)`` fetches the data within ``timeout_s``.
     PENDING -> RECEIVING.
  5. Verify (decode): per-layer checksums, the header's layout against the location and the
     decode engine's layout (``KVPayloadMismatchError``); a bad or missing layer or a timeout
     is ``KVTransferError``. Either one -> FAILED, and the decode side falls back (recompute).
  6. Import (decode): ``receive`` returns a ``KVPayload``; the worker passes it to the engine.
     RECEIVING -> DONE.
  7. Release: the receiver frees the transport's copy as soon as it has read it (store:
     read-and-delete; shm: unlink the segment; a reused slot is freed once the engine imported
     the payload, ``KVPayload.release``); ``await receiver.discard()`` is the idempotent
     backstop on every path. What a crashed process leaves behind, ``janitor.reclaim_orphans``
     frees.

Both sides keep a ``HandoffRecord`` (``record``) of their stamps. Backends: ``transfer.stream``
(``store``/``direct``: the layer stream into the KV store, or pushed into the decode worker),
``transfer.shm`` (same host), ``transfer.fake`` (in memory, on the stream's real frames;
tests). What a hand-off does with its sender (which one, layer-wise or deferred, a cached
prefix left out, announced) is its prefill connector's (``pdserve.handoff``).

This module imports no torch (the policy and janitor use it from torch-free processes); the
tensor-facing types appear in annotations only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

from pdserve.errors import InvalidArgumentError, KVTransferError
from pdserve.transfer.handle import (
    KVLocation,
    NativeKV,
    TransportKind,
)
from pdserve.transfer.record import HandoffRecord

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray
    from pdserve.engine.kv_payload import KVLayout, KVPayload

__all__ = [
    "HandoffRecord",
    "KVLocation",
    "KVReceiver",
    "KVSender",
    "NativeKV",
    "ReceiverFactory",
    "SenderFactory",
    "TransferState",
    "Transport",
    "TransportKind",
    "TransportRegistry",
    "advance",
]


class TransferState(IntEnum):
    """Where one side of a hand-off is. Ordered: ``state >= DONE`` means terminal."""

    PENDING = 0
    SENDING = 1
    SENT = 2
    RECEIVING = 3
    DONE = 4
    FAILED = 5

    @property
    def terminal(self) -> bool:
        return self >= TransferState.DONE


# Legal moves; everything else is a caller bug (e.g. ``send_layer`` before ``begin``).
_TRANSITIONS: dict[TransferState, frozenset[TransferState]] = {
    TransferState.PENDING: frozenset(
        {TransferState.SENDING, TransferState.RECEIVING, TransferState.FAILED}
    ),
    TransferState.SENDING: frozenset({TransferState.SENT, TransferState.FAILED}),
    TransferState.SENT: frozenset({TransferState.FAILED}),  # abort after hand-off revokes it
    TransferState.RECEIVING: frozenset({TransferState.DONE, TransferState.FAILED}),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
}


def advance(current: TransferState, new: TransferState) -> TransferState:
    """``new`` if the move from ``current`` is legal, else ``KVTransferError``."""
    if new not in _TRANSITIONS[current]:
        raise KVTransferError(f"KV transfer cannot go from {current.name} to {new.name}")
    return new


class KVSender(Protocol):
    """The prefill side of one hand-off (steps 1-3 of the lifecycle)."""

    @property
    def kind(self) -> TransportKind: ...

    @property
    def state(self) -> TransferState: ...

    @property
    def record(self) -> HandoffRecord:
        """This side's stamps, filled as the hand-off goes."""
        ...

    @property
    def busy_ns(self) -> int:
        """Time the transport was busy moving bytes (idle waits for the compute excluded)."""
        ...

    def begin(self, request_id: str, layout: KVLayout, num_tokens: int) -> None:
        """Reserve room for the header and every layer. Raises on failure (nothing held)."""
        ...

    def planned(self) -> KVLocation:
        """After ``begin``: where the data is going (what ``commit`` will return)."""
        ...

    def send_layer(self, layer: int, k: KVArray, v: KVArray) -> None:
        """A ``LayerHook``: write one layer's ``[num_tokens, kvh, hd]`` K and V (the engine's
        gathered copies, which a sender may keep). Never raises; a failure surfaces in
        ``commit``."""
        ...

    async def commit(self, timeout_s: float) -> KVLocation:
        """Check that every layer arrived, seal (within ``timeout_s``), say where the data is.
        ``KVTransferError`` (or another ``PdServeError``) when it cannot."""
        ...

    async def discard(self) -> None:
        """Free whatever ``begin`` reserved (idempotent); after ``commit``, revoke."""
        ...


class KVReceiver(Protocol):
    """The decode side of one hand-off, made for one ``KVLocation`` (steps 4-7)."""

    @property
    def kind(self) -> TransportKind: ...

    @property
    def state(self) -> TransferState: ...

    @property
    def record(self) -> HandoffRecord:
        """This side's stamps, filled as the hand-off goes."""
        ...

    @property
    def compression(self) -> str:
        """The payload's encoding as it travelled (known once ``receive`` read the header)."""
        ...

    async def receive(self, timeout_s: float) -> KVPayload:
        """Fetch, verify and return the payload within ``timeout_s``, then free the
        transport's copy."""
        ...

    async def discard(self) -> None:
        """Free the transport's copy if ``receive`` did not (idempotent)."""
        ...


class SenderFactory(Protocol):
    """A fresh sender for one hand-off; ``peer_address``: the decode worker's address
    (``direct`` pushes into it; the others ignore it)."""

    def __call__(self, peer_address: str) -> KVSender: ...


class ReceiverFactory(Protocol):
    """A fresh receiver of ``location``; ``follow``: one that reads while the writer still
    writes (a prefetch)."""

    def __call__(self, location: KVLocation, *, follow: bool = False) -> KVReceiver: ...


@dataclass(frozen=True, slots=True)
class Transport:
    """Factories of one implementation, as one process uses it: a prefill worker registers
    senders, a decode worker receivers (None: this process does not use that side)."""

    sender: SenderFactory | None = None
    receiver: ReceiverFactory | None = None


@dataclass(slots=True)
class TransportRegistry:
    """Implementations by kind: the seam between a hand-off's connector and its transports.
    Each connector builds its own, bound to its resources (its KV store clients, copy threads,
    shm slots), or is given one (the in-memory fake of tests, ``fake.fake_transports``);
    ``recompute`` and ``native`` move nothing through pdserve and have none."""

    implementations: dict[TransportKind, Transport] = field(default_factory=dict)

    def register(self, kind: TransportKind, transport: Transport) -> None:
        if kind in (TransportKind.RECOMPUTE, TransportKind.NATIVE):
            raise InvalidArgumentError("kind", f"{kind.value} moves no data through pdserve")
        if kind in self.implementations:
            raise InvalidArgumentError("kind", f"transport {kind.value!r} is already registered")
        self.implementations[kind] = transport

    def get(self, kind: TransportKind) -> Transport:
        try:
            return self.implementations[kind]
        except KeyError:
            known = sorted(k.value for k in self.implementations)
            raise InvalidArgumentError(
                "transport", f"{kind.value!r} is not available here; registered: {known}"
            ) from None

    def sender(self, kind: TransportKind, peer_address: str = "") -> KVSender:
        """A sender of ``kind``; ``InvalidArgumentError`` when this process has none."""
        make = self.get(kind).sender
        if make is None:
            raise InvalidArgumentError("transport", f"{kind.value!r} sends nothing here")
        return make(peer_address)

    def receiver(self, location: KVLocation, *, follow: bool = False) -> KVReceiver:
        """A receiver of ``location``; ``InvalidArgumentError`` when this process has none."""
        make = self.get(location.kind).receiver
        if make is None:
            raise InvalidArgumentError(
                "transport", f"{location.kind.value!r} receives nothing here"
            )
        return make(location, follow=follow)
