"""One hand-off of ``pdserve bench transfer`` as the workers measured it (``Sample``), and a
transport's bandwidth from its two sides; the paired rounds (``transfer_paired``) and the report
(``transfer_report``) build on both (definitions in ``docs/benchmarks.md``)."""

from __future__ import annotations

from dataclasses import dataclass


def link_bytes_per_s(transport: str, send: float, recv: float) -> float:
    """A transport's bandwidth: its slower side (direct: the send; its read is the decode
    worker handing over what its endpoint assembled on arrival)."""
    return send if transport == "direct" else min(send, recv)


@dataclass
class Sample:
    """One hand-off as the workers measured it (ms, bytes, bytes/s)."""

    transport: str
    layerwise: bool
    tokens: int
    num_bytes: int
    prefill_rpc_ms: float
    compute_ms: float
    overlap_ms: float
    exposed_ms: float
    send_bytes_per_s: float
    recv_ms: float
    recv_bytes_per_s: float
    recompute_ms: float
    send_start_ns: int
    send_end_ns: int
    recv_start_ns: int
    recv_end_ns: int
    reused: bool = False
    """The prompt's KV came from the prefix cache (a bandwidth-only point: no compute)."""
    wait_ms: float = -1.0
    """How long the Decode call waited for the KV (a prefetch: only its tail); -1: a run
    recorded before it was measured, where the Decode call waited for the whole read."""
    first_visible_ms: float = -1.0
    """``visible_ms`` of the point's first run, the first hand-off of its size through these
    processes (its buffers fault in); -1: a run recorded before it was kept."""
    ref_memcpy: float = 0.0
    ref_tcp: float = 0.0
    ref_grpc: float = 0.0
    """References (bytes/s) measured right before this point's runs, in runs recorded before
    the paired rounds (0: not measured)."""

    @property
    def latency_ms(self) -> float:
        """First byte sent to the KV checked on the decode side (one host's monotonic clock
        on both sides; direct: until its send was acknowledged, where the KV was checked)."""
        end = max(self.send_end_ns, self.recv_end_ns)
        return (end - self.send_start_ns) / 1e6 if end > self.send_start_ns else 0.0

    @property
    def waited_ms(self) -> float:
        return self.recv_ms if self.wait_ms < 0 else self.wait_ms

    @property
    def send_span_bytes_per_s(self) -> float:
        """Bytes over the sender's whole span, first layer to acknowledgement (deferred: the
        pipeline of copy, checksum and wire with every layer at hand)."""
        ns = self.send_end_ns - self.send_start_ns
        return self.num_bytes / (ns / 1e9) if ns > 0 else 0.0

    @property
    def ready_ms(self) -> float:
        """Until the decode worker can start: the Prefill RPC, then what is left of the read
        (or the recompute)."""
        return self.prefill_rpc_ms + self.waited_ms + self.recompute_ms

    @property
    def visible_ms(self) -> float:
        """Transfer time not hidden behind the compute: the sender's after the compute, and
        the decode worker's wait for the read."""
        return self.exposed_ms + self.waited_ms

    @property
    def share(self) -> float:
        return self.visible_ms / self.ready_ms if self.ready_ms else 0.0

    @property
    def hidden(self) -> float:
        """Of the sender's transfer time, the part that ran while the prefill computed."""
        total = self.overlap_ms + self.exposed_ms
        return self.overlap_ms / total if total else 0.0
