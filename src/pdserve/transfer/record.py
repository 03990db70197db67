"""``HandoffRecord``: one hand-off as measured by one side (``pdserve.v1.TransferTiming``).

A sender fills ``send_*``, ``first/last_layer_ns`` and ``hook_ns`` as it goes; the prefill
worker adds ``compute_end_ns``, ``busy_ns`` and the settings once it commits. A receiver fills
``recv_*``; the decode worker adds ``wait_ms``/``prefetched``. The figures derived from the
stamps (overlap, exposed time, bytes/s, ...) are the properties below and nowhere else.

Stamps are ``time.monotonic_ns`` (same-host comparable only), 0 where unset. Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class HandoffRecord:
    """One side of one hand-off; see ``pdserve.v1.TransferTiming`` for each field."""

    transport: str
    """A ``TransportKind`` value (``recompute``/``native`` when nothing moved through us)."""
    num_bytes: int = 0
    send_start_ns: int = 0
    """Sender: ``begin`` (reservation)."""
    first_layer_ns: int = 0
    last_layer_ns: int = 0
    compute_end_ns: int = 0
    """Sender: when the prefill's compute ended (set by the prefill worker)."""
    send_end_ns: int = 0
    """Sender: ``commit`` returned (sealed, acknowledged)."""
    recv_start_ns: int = 0
    recv_end_ns: int = 0
    hook_ns: int = 0
    """Sender: time spent inside ``send_layer`` and the seal: transfer work on the sender."""
    busy_ns: int = 0
    """Sender: time the transport was busy moving bytes (waits for the compute excluded)."""
    compression: str = "none"
    layerwise: bool = True
    fallback_reason: str = ""
    """Why the hand-off fell back (to recompute); empty when it did not."""
    wait_ms: float = 0.0
    """Receiver: how long the Decode call waited for the payload (a prefetch: its tail)."""
    prefetched: bool = False
    """Receiver: the read began at the prefill's announcement, before the Decode call."""

    def hooked(self, start_ns: int, end_ns: int) -> None:
        """One layer hook's call ran from ``start_ns`` to ``end_ns`` (``time.monotonic_ns``):
        what every sender's ``send_layer`` records."""
        self.hook_ns += end_ns - start_ns
        self.first_layer_ns = self.first_layer_ns or start_ns
        self.last_layer_ns = end_ns

    def replace(self, **changes: object) -> HandoffRecord:
        """A copy with ``changes`` (the record a transport fills stays its own)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def received(self, *, compression: str = "none", wait_ms: float | None = None) -> HandoffRecord:
        """The receiver's record as the decode worker reports it; ``wait_ms`` None: the Decode
        call waited for the whole read, else the read was a prefetch and the call waited
        ``wait_ms`` for its tail."""
        record = HandoffRecord(
            transport=self.transport,
            num_bytes=self.num_bytes,
            recv_start_ns=self.recv_start_ns,
            recv_end_ns=self.recv_end_ns,
            compression=compression,
        )
        if wait_ms is None:
            return record.replace(wait_ms=record.recv_ms)
        return record.replace(wait_ms=wait_ms, prefetched=True)

    @property
    def transfer_start_ns(self) -> int:
        """When data started to move: the first layer (or the commit, if nothing was hooked)."""
        return self.first_layer_ns or self.send_start_ns

    @property
    def overlap_ms(self) -> float:
        """Sender: transfer time spent while the prefill was still computing (0 when the KV
        moved only after the compute, or the compute's end is unknown)."""
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
        """Receiver: start of the read to a verified payload."""
        if not self.recv_end_ns:
            return 0.0
        return max(0, self.recv_end_ns - self.recv_start_ns) / 1e6

    @property
    def bytes_per_s(self) -> float:
        """Bytes over this side's busy time: the receiver's read, the sender's busy time
        (0 when nothing was measured)."""
        ms = self.recv_ms or self.busy_ns / 1e6 or self.send_ms
        return self.num_bytes / (ms / 1e3) if ms > 0 and self.num_bytes else 0.0
