"""The transport interface of a KV hand-off, its states, descriptor and statistics.

Lifecycle of one hand-off (one ``KVSender`` on the prefill worker, one ``KVReceiver`` on the
decode worker, both used once):

  1. Reserve (prefill): ``sender.begin(request_id, engine.layout, num_prompt_tokens)`` before
     the request is added; the transport reserves room for the header and every layer (an shm
     segment, a store entry, a stream). PENDING -> SENDING.
  2. Send (prefill): the engine runs the request with ``hold_kv=True, layer_hook=
     sender.send_layer``; during the final prefill chunk the hook fires once per layer with
     that layer's ``[num_tokens, kv_heads, head_dim]`` K and V, and the transport writes them
     out while the later layers are still being computed. ``send_layer`` never raises into the
     engine (that would fail the whole batch): a failure is recorded and raised by ``finish``.
  3. Commit/seal (prefill): after the first token, ``sender.finish()`` checks every layer
     arrived, seals the data and returns a ``TransferDescriptor`` (the ``KVHandle`` of the
     RPC). SENDING -> SENT. Ownership of the data passes to the receiver. The worker then frees
     the engine's held blocks (``release_kv``). On any failure before that, ``sender.abort()``
     frees what ``begin`` reserved (-> FAILED); after SENT, ``abort`` revokes the hand-off.
  4. Receive (decode): ``await receiver.receive(descriptor, timeout_s)`` fetches the data.
     PENDING -> RECEIVING.
  5. Verify (decode): per-layer CRC-32s, the header's layout against the descriptor and the
     decode engine's layout (``KVPayloadMismatchError``); a bad or missing layer or a timeout
     is ``KVTransferError``. Either one -> FAILED, and the decode side falls back (recompute).
  6. Import (decode): ``receive`` returns a ``KVPayload``; the worker passes it to
     ``engine.add_request(..., kv=payload, first_token=...)``. RECEIVING -> DONE.
  7. Release: the receiver frees the transport's copy as soon as it has read it (shm: unlink
     the segment; a reused slot is freed once the engine imported the payload,
     ``KVPayload.release``) on success and on failure; ``receiver.cleanup()`` is the
     idempotent backstop for cancellation. What a crashed process leaves behind,
     ``janitor.reclaim_orphans`` frees.

This module imports no torch (the policy and janitor use it from torch-free processes); the
tensor-facing types appear in annotations only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Protocol

from pdserve.errors import InvalidArgumentError, KVTransferError

if TYPE_CHECKING:
    import torch

    from pdserve.engine.kv_payload import KVLayout, KVPayload


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


class TransportKind(StrEnum):
    """How the KV gets from prefill to decode. Values are the ``Timing.transport`` names."""

    STORE = "store"
    """Through the KVStore service (put by prefill, get by decode)."""
    DIRECT = "direct"
    """Streamed from the prefill worker's own KV endpoint to the decode worker."""
    SHM = "shm"
    """A POSIX shared-memory segment; prefill and decode on the same host."""
    RECOMPUTE = "recompute"
    """Nothing moves: the decode worker prefills the prompt again."""
    NATIVE = "native"
    """The engines move it themselves (TensorRT-LLM's cache transceiver): pdserve carries only
    the handle (``pdserve.backends.NativeKV``)."""


@dataclass(frozen=True, slots=True)
class TransferDescriptor:
    """What ``finish`` returns and the decode side needs: the ``KVHandle`` of the RPC.

    ``layout`` and ``layer_checksums`` are None/empty when the descriptor was rebuilt from a
    ``KVHandle`` (which carries neither); transports whose data is self-describing (shm) then
    read both from the data itself.
    """

    kind: TransportKind
    request_id: str
    num_tokens: int
    num_bytes: int
    """KV bytes moved (the shm segment's length, the stream's size)."""
    model_fingerprint: str
    name: str
    """shm: the segment name; store/direct: the key; fake: the stream key."""
    host: str = ""
    """shm: the writer's host name; store/direct: the endpoint's host:port."""
    offset: int = 0
    length: int = 0
    layout: KVLayout | None = None
    layer_checksums: tuple[int, ...] = ()
    """CRC-32 of each layer's bytes as sent (K then V)."""
    compression: str = "none"
    generation: int = 0
    """shm: the hand-off's generation in a reused slot (``slots.py``); 0: a one-off segment."""
    capability: bytes = b""
    """16 random bytes the writer chose for this hand-off (``stamp.py``): what a reader must
    present to read, claim, free or unlink it. store/direct: part of the key as well."""


@dataclass(slots=True)
class TransferStats:
    """Timings of one side of a hand-off (``time.monotonic_ns``; same-host comparable only).

    The sender fills ``send_*``, ``first/last_layer_ns`` and ``hook_ns``; the receiver fills
    ``recv_*``. ``merged`` combines the two sides' records of one hand-off.
    """

    transport: TransportKind
    num_bytes: int = 0
    send_start_ns: int = 0
    """``begin`` (reservation)."""
    send_end_ns: int = 0
    """``finish`` returned (sealed)."""
    first_layer_ns: int = 0
    last_layer_ns: int = 0
    hook_ns: int = 0
    """Time spent inside ``send_layer`` and ``finish``: transfer work on the sender."""
    recv_start_ns: int = 0
    recv_end_ns: int = 0
    fallback_reason: str = ""
    """Why the hand-off fell back (to recompute); empty when it did not."""

    @property
    def overlap_ms(self) -> float:
        """Span of the layer writes: transfer interleaved with the prefill's forward pass.

        0 when the KV moved only after compute (export, then put).
        """
        if not (self.first_layer_ns and self.last_layer_ns):
            return 0.0
        return (self.last_layer_ns - self.first_layer_ns) / 1e6

    @property
    def send_ms(self) -> float:
        return max(0, self.send_end_ns - self.send_start_ns) / 1e6 if self.send_end_ns else 0.0

    @property
    def recv_ms(self) -> float:
        return max(0, self.recv_end_ns - self.recv_start_ns) / 1e6 if self.recv_end_ns else 0.0

    @property
    def bytes_per_s(self) -> float:
        """Bytes over the busier side's transfer time (the bottleneck); 0 when unknown."""
        busy_ns = max(
            self.hook_ns, self.recv_end_ns - self.recv_start_ns if self.recv_end_ns else 0
        )
        return self.num_bytes * 1e9 / busy_ns if busy_ns > 0 and self.num_bytes else 0.0

    def merged(self, other: TransferStats) -> TransferStats:
        """This record with every unset (zero/empty) field taken from ``other``."""
        values = {
            name: getattr(self, name) or getattr(other, name) for name in self.__dataclass_fields__
        }
        return TransferStats(**values)


class KVSender(Protocol):
    """The prefill side of one hand-off (steps 1-3 of the lifecycle)."""

    kind: TransportKind
    state: TransferState
    stats: TransferStats

    def begin(self, request_id: str, layout: KVLayout, num_tokens: int) -> None:
        """Reserve room for the header and every layer. Raises on failure (nothing held)."""
        ...

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A ``LayerHook``: write one layer's ``[num_tokens, kvh, hd]`` K and V (views valid
        only during the call). Never raises; a failure surfaces in ``finish``."""
        ...

    def finish(self) -> TransferDescriptor:
        """Check that every layer arrived, seal, and describe where the data is."""
        ...

    def abort(self) -> None:
        """Free whatever ``begin`` reserved (idempotent); after ``finish``, revoke."""
        ...


class KVReceiver(Protocol):
    """The decode side of one hand-off (steps 4-7 of the lifecycle)."""

    kind: TransportKind
    state: TransferState
    stats: TransferStats

    async def receive(self, descriptor: TransferDescriptor, timeout_s: float) -> KVPayload:
        """Fetch, verify and return the payload, then free the transport's copy."""
        ...

    def cleanup(self) -> None:
        """Free the transport's copy if ``receive`` did not (idempotent)."""
        ...


@dataclass(frozen=True, slots=True)
class Transport:
    """Factories of one implementation: a fresh sender/receiver per hand-off."""

    sender: Callable[[], KVSender]
    receiver: Callable[[], KVReceiver]


@dataclass(slots=True)
class TransportRegistry:
    """Implementations by kind. Each process builds its own (see ``default_registry``)."""

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


def default_registry(*, host: str | None = None) -> TransportRegistry:
    """A registry with the transports that need no service: shm (on this host).

    Its shm senders and receivers share one copy thread (a ``ThreadPoolExecutor`` owned by
    the registry, started on first use): each hand-off copies or checks K there while its own
    thread does V. A pool task never waits on another, so sharing it cannot deadlock.
    """
    # Imported here: shm imports this module (and torch), which callers of the policy avoid.
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.transfer.shm import ShmReceiver, ShmSender

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shm-copy")
    registry = TransportRegistry()
    registry.register(
        TransportKind.SHM,
        Transport(
            lambda: ShmSender(host=host, pool=pool), lambda: ShmReceiver(host=host, pool=pool)
        ),
    )
    return registry
