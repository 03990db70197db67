"""Choosing how one hand-off moves its KV, and how long to wait for it. Torch-free.

``choose_transport``:
  1. Same host (and shm allowed) -> ``shm``: a memory copy, no network.
  2. Else estimate the transfer (``latency + bytes / bandwidth``, bandwidth an EWMA of what
     this link measured) and the recompute (``tokens / prefill throughput`` of the decode
     worker). If moving the KV would take longer than computing it again -> ``recompute``.
  3. Else the configured network transport: ``direct`` (or ``store``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError
from pdserve.transfer.base import TransportKind

DEFAULT_BYTES_PER_S = 1.0e9
"""Assumed bandwidth of a link nothing was measured on yet (about a 10 GbE NIC)."""
DEFAULT_LATENCY_S = 0.001


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """What is believed about one (src, dst, transport) link."""

    bytes_per_s: float
    latency_s: float
    samples: int
    """Measurements behind ``bytes_per_s`` (0: the default)."""

    def transfer_time_s(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


class LinkEstimates:
    """An EWMA of measured bandwidth per (src host, dst host, transport).

    The first measurement of a link replaces the default; later ones move the estimate by
    ``alpha`` of the difference. Latency is configured, not measured: it is charged once per
    transfer in ``transfer_time_s`` and subtracted from each measurement before it is turned
    into a bandwidth (else small transfers would make the link look slow).
    """

    def __init__(
        self,
        *,
        alpha: float = 0.25,
        default_bytes_per_s: float = DEFAULT_BYTES_PER_S,
        latency_s: float = DEFAULT_LATENCY_S,
    ) -> None:
        if not 0 < alpha <= 1:
            raise InvalidArgumentError("alpha", f"must be in (0, 1], got {alpha}")
        if not default_bytes_per_s > 0:
            raise InvalidArgumentError(
                "default_bytes_per_s", f"must be > 0, got {default_bytes_per_s}"
            )
        if not latency_s >= 0:
            raise InvalidArgumentError("latency_s", f"must be >= 0, got {latency_s}")
        self.alpha = alpha
        self.default_bytes_per_s = default_bytes_per_s
        self.latency_s = latency_s
        self._links: dict[tuple[str, str, TransportKind], LinkEstimate] = {}

    def observe(
        self, src: str, dst: str, transport: TransportKind, num_bytes: int, seconds: float
    ) -> LinkEstimate:
        """Fold one measured transfer into the link's estimate; returns the new estimate."""
        if num_bytes <= 0:
            raise InvalidArgumentError("num_bytes", f"must be > 0, got {num_bytes}")
        if not seconds > 0:
            raise InvalidArgumentError("seconds", f"must be > 0, got {seconds}")
        # Floor: a transfer faster than the assumed latency still counts as moving data.
        sample = num_bytes / max(seconds - self.latency_s, seconds / 10)
        key = (src, dst, transport)
        old = self._links.get(key)
        if old is None:
            new = LinkEstimate(sample, self.latency_s, 1)
        else:
            bw = old.bytes_per_s + self.alpha * (sample - old.bytes_per_s)
            new = LinkEstimate(bw, self.latency_s, old.samples + 1)
        self._links[key] = new
        return new

    def measured(self) -> list[tuple[str, str, TransportKind, LinkEstimate]]:
        """Every link measured at least once: ``(src, dst, transport, estimate)``."""
        return [(src, dst, kind, est) for (src, dst, kind), est in self._links.items()]

    def estimate(self, src: str, dst: str, transport: TransportKind) -> LinkEstimate:
        found = self._links.get((src, dst, transport))
        return found or LinkEstimate(self.default_bytes_per_s, self.latency_s, 0)

    def transfer_time_s(
        self, src: str, dst: str, transport: TransportKind, num_bytes: int
    ) -> float:
        return self.estimate(src, dst, transport).transfer_time_s(num_bytes)


def same_host(a: str, b: str) -> bool:
    """Host names name one machine (case-insensitive); an empty name matches nothing."""
    return bool(a) and a.lower() == b.lower()


def choose_transport(
    prefill_host: str,
    decode_host: str,
    num_tokens: int,
    kv_bytes: int,
    measured: LinkEstimates,
    prefill_tokens_per_s: float,
    *,
    network: TransportKind = TransportKind.DIRECT,
    allow_shm: bool = True,
    allow_recompute: bool = True,
) -> TransportKind:
    """The transport for one hand-off (see the module docstring for the rules).

    ``prefill_tokens_per_s``: prefill throughput of the worker that would recompute (the
    decode worker). ``network``: ``direct`` or ``store``, what a cross-host hand-off uses.
    """
    if network not in (TransportKind.DIRECT, TransportKind.STORE):
        raise InvalidArgumentError("network", f"must be direct or store, got {network.value!r}")
    if num_tokens < 0:
        raise InvalidArgumentError("num_tokens", f"must be >= 0, got {num_tokens}")
    if kv_bytes < 0:
        raise InvalidArgumentError("kv_bytes", f"must be >= 0, got {kv_bytes}")
    if not prefill_tokens_per_s > 0:
        raise InvalidArgumentError(
            "prefill_tokens_per_s", f"must be > 0, got {prefill_tokens_per_s}"
        )
    if allow_shm and same_host(prefill_host, decode_host):
        return TransportKind.SHM
    transfer_s = measured.transfer_time_s(prefill_host, decode_host, network, kv_bytes)
    recompute_s = num_tokens / prefill_tokens_per_s
    if allow_recompute and transfer_s > recompute_s:
        return TransportKind.RECOMPUTE
    return network


def default_timeout_s(
    num_bytes: int,
    bytes_per_s: float,
    *,
    factor: float = 4.0,
    slack_s: float = 0.5,
    floor_s: float = 1.0,
    ceiling_s: float = 5.0,
) -> float:
    """``clamp(factor * expected + slack_s, floor_s, ceiling_s)``, expected = bytes / bandwidth.

    Generous against jitter, but bounded: past the ceiling, recomputing beats waiting.
    """
    if num_bytes < 0:
        raise InvalidArgumentError("num_bytes", f"must be >= 0, got {num_bytes}")
    if not bytes_per_s > 0:
        raise InvalidArgumentError("bytes_per_s", f"must be > 0, got {bytes_per_s}")
    if not 0 < floor_s <= ceiling_s:
        raise InvalidArgumentError(
            "floor_s", f"need 0 < floor_s <= ceiling_s, got {floor_s}, {ceiling_s}"
        )
    expected = num_bytes / bytes_per_s
    return min(max(factor * expected + slack_s, floor_s), ceiling_s)
