"""What a prefill worker hands to a decode worker: where the KV lies, and how its move went.

``KVLocation`` is the worker's side of ``pdserve.v1.KVHandle`` (one of its ``location``s);
``TransferRecord`` is one hand-off measured on both sides (``pdserve.v1.TransferTiming``).

Every hand-off carries a capability, 16 random bytes (``transfer.stamp``): a store or direct
entry's key ends with their hex (``kvstore.keys.handoff_key``), so naming the entry takes
knowing them, and an shm segment holds them. Only the prefill worker that wrote the KV and
whoever it answered (the router, then the decode worker) know them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.backends import NativeKV
from pdserve.kvstore import keys as _keys
from pdserve.transfer.base import TransferDescriptor, TransferStats, TransportKind

# The hand-off key namespace is defined with the store's others (``kvstore.keys``); these
# names stay for the code that takes them from here.
STORE_KEY_PREFIX = _keys.HANDOFF_PREFIX
store_key = _keys.handoff_key


@dataclass(frozen=True, slots=True)
class KVLocation:
    """Where a request's prompt KV is (the ``KVHandle`` of the RPC)."""

    kind: TransportKind
    request_id: str
    num_tokens: int
    """Tokens whose KV the payload holds (the prompt length, less ``prefix_tokens``)."""
    num_bytes: int
    """Size of the payload as it lies there (layer stream, or shm segment)."""
    model_fingerprint: str
    """``kv_payload.kv_fingerprint`` of the writer; a reader with another one refuses it."""
    address: str = ""
    """store/direct: host:port of the KVStore endpoint holding it."""
    key: str = ""
    """store/direct: the entry's key; shm: the segment's name."""
    host: str = ""
    """shm: the writer's host name."""
    offset: int = 0
    length: int = 0
    generation: int = 0
    """shm: the hand-off's generation in a reused slot (``transfer.slots``); 0: one-off."""
    reason: str = ""
    """recompute: why nothing moved."""
    prefix_tokens: int = 0
    """Leading prompt tokens left out of the payload: the decode worker's prefix cache holds
    them (``prefix.DecodePrefix``). ``prefix_tokens + num_tokens`` is the prompt length."""
    capability: bytes = field(default=b"", repr=False)
    """The hand-off's capability (module docstring); recompute: that of the hand-off that
    fell back, if one began (it lets the decode worker drop that hand-off's prefetch)."""
    native: NativeKV | None = None
    """native: the handle of the KV the prefill worker's engine keeps for its own transfer
    (no capability: the engines' own transfer carries none of pdserve's)."""

    @classmethod
    def recompute(
        cls,
        request_id: str,
        num_tokens: int,
        fingerprint: str,
        reason: str,
        capability: bytes = b"",
    ) -> KVLocation:
        """Nothing moved: the decode worker prefills the prompt itself."""
        return cls(
            TransportKind.RECOMPUTE, request_id, num_tokens, 0, fingerprint, reason=reason,
            capability=capability,
        )  # fmt: skip

    @classmethod
    def of_native(
        cls, request_id: str, num_tokens: int, fingerprint: str, native: NativeKV
    ) -> KVLocation:
        """The engine keeps the KV; the decode worker's engine pulls it (``native``)."""
        return cls(TransportKind.NATIVE, request_id, num_tokens, 0, fingerprint, native=native)

    @classmethod
    def of(cls, d: TransferDescriptor, fingerprint: str) -> KVLocation:
        """The location a sender's ``finish`` described."""
        if d.kind is TransportKind.SHM:
            return cls(
                d.kind, d.request_id, d.num_tokens, d.num_bytes, fingerprint,
                key=d.name, host=d.host, offset=d.offset, length=d.length,
                generation=d.generation, capability=d.capability,
            )  # fmt: skip
        return cls(
            d.kind, d.request_id, d.num_tokens, d.num_bytes, fingerprint, address=d.host,
            key=d.name, capability=d.capability,
        )  # fmt: skip

    def descriptor(self) -> TransferDescriptor:
        """The receiver's view (no layout or checksums: the data describes itself)."""
        if self.kind is TransportKind.SHM:
            return TransferDescriptor(
                self.kind, self.request_id, self.num_tokens, self.num_bytes, "",
                name=self.key, host=self.host, offset=self.offset, length=self.length,
                generation=self.generation, capability=self.capability,
            )  # fmt: skip
        return TransferDescriptor(
            self.kind, self.request_id, self.num_tokens, self.num_bytes, "",
            name=self.key, host=self.address, capability=self.capability,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One hand-off as measured by one side (``time.monotonic_ns`` stamps); see
    ``pdserve.v1.TransferTiming`` for each field."""

    transport: str
    num_bytes: int = 0
    send_start_ns: int = 0
    first_layer_ns: int = 0
    last_layer_ns: int = 0
    compute_end_ns: int = 0
    send_end_ns: int = 0
    recv_start_ns: int = 0
    recv_end_ns: int = 0
    hook_ns: int = 0
    busy_ns: int = 0
    """Sender: time the transport was busy moving bytes (waits for the compute excluded)."""
    compression: str = "none"
    layerwise: bool = True
    fallback_reason: str = ""
    wait_ms: float = 0.0
    """Receiver: how long the Decode call waited for the payload (a prefetch: its tail)."""
    prefetched: bool = False
    """Receiver: the read began at the prefill's announcement, before the Decode call."""

    @classmethod
    def sent(
        cls,
        stats: TransferStats,
        *,
        compute_end_ns: int,
        busy_ns: int,
        compression: str,
        layerwise: bool,
    ) -> TransferRecord:
        """The sender's side, from its stats and when the compute ended."""
        return cls(
            busy_ns=busy_ns,
            transport=stats.transport.value,
            num_bytes=stats.num_bytes,
            send_start_ns=stats.send_start_ns,
            first_layer_ns=stats.first_layer_ns,
            last_layer_ns=stats.last_layer_ns,
            compute_end_ns=compute_end_ns,
            send_end_ns=stats.send_end_ns,
            hook_ns=stats.hook_ns,
            compression=compression,
            layerwise=layerwise,
        )

    @classmethod
    def received(
        cls, stats: TransferStats, *, compression: str = "none", wait_ms: float | None = None
    ) -> TransferRecord:
        """The receiver's side; ``wait_ms`` None: the Decode call waited for the whole read,
        else the read was a prefetch and the call waited ``wait_ms`` for its tail."""
        record = cls(
            transport=stats.transport.value,
            num_bytes=stats.num_bytes,
            recv_start_ns=stats.recv_start_ns,
            recv_end_ns=stats.recv_end_ns,
            compression=compression,
        )
        if wait_ms is None:
            return record.replace(wait_ms=record.recv_ms)
        return record.replace(wait_ms=wait_ms, prefetched=True)

    def replace(self, **changes: object) -> TransferRecord:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def transfer_start_ns(self) -> int:
        """When data started to move: the first layer (or the commit, if nothing was hooked)."""
        return self.first_layer_ns or self.send_start_ns

    @property
    def overlap_ms(self) -> float:
        """Sender: transfer time spent while the prefill was still computing."""
        if not (self.send_end_ns and self.compute_end_ns and self.first_layer_ns):
            return 0.0
        end = min(self.send_end_ns, self.compute_end_ns)
        return max(0, end - self.first_layer_ns) / 1e6

    @property
    def exposed_ms(self) -> float:
        """Sender: time from the end of the compute (or the first layer, if later) to the
        commit; this part of the transfer adds to the time to first token."""
        if not (self.send_end_ns and self.compute_end_ns):
            return 0.0
        start = max(self.compute_end_ns, self.first_layer_ns)
        return max(0, self.send_end_ns - start) / 1e6

    @property
    def send_ms(self) -> float:
        """Sender: first layer to commit (the whole transfer, hidden part included)."""
        if not self.send_end_ns:
            return 0.0
        return max(0, self.send_end_ns - self.transfer_start_ns) / 1e6

    @property
    def recv_ms(self) -> float:
        if not self.recv_end_ns:
            return 0.0
        return max(0, self.recv_end_ns - self.recv_start_ns) / 1e6

    @property
    def bytes_per_s(self) -> float:
        """Bytes over this side's busy time: the receiver's read, the sender's busy time
        (0 when nothing was measured)."""
        ms = self.recv_ms or self.busy_ns / 1e6 or self.send_ms
        return self.num_bytes / (ms / 1e3) if ms > 0 and self.num_bytes else 0.0
