"""The one model of the KV links: what a hand-off costs, and which transport it takes.
Torch-free.

A ``Link`` moves ``b`` bytes in ``latency + b / bandwidth``. ``Links``: what one host believes
of its links per (peer host, transport), an EWMA of what its hand-offs measured, else the
transport's prior (``PRIORS``, the only priors); published in heartbeats, read back by the
scheduler; a sim worker's hold the modelled link (``sim.links`` are ``Link``s too).

``choose_transport`` is the one rule, by which the prefill worker picks each hand-off's
transport (``handoff.plan``) and the scheduler prices it (``scheduling.costmodel``), among
the transports the worker allows (``allowed_transports``, also in its heartbeat):

1. One transport allowed (forced): that one.
2. Same host (case-insensitive, non-empty) and ``shm`` allowed -> ``shm``.
3. Else the network transport allowed (``direct``, else ``store``), unless moving the KV would
   take longer than computing it again (``recompute``, if allowed): ``step overhead + tokens *
   per-token cost`` of the prefill worker's step model (the decode worker runs the same
   model); not measured yet, recompute is never chosen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from pdserve.errors import InvalidArgumentError
from pdserve.transfer.base import HandoffRecord, TransportKind

SHM, DIRECT, STORE, RECOMPUTE = (
    TransportKind.SHM, TransportKind.DIRECT, TransportKind.STORE, TransportKind.RECOMPUTE
)  # fmt: skip
LATENCY_S = 0.001
"""Per-transfer latency of a link (configured, not measured: a call's set-up)."""
PRIORS: Mapping[TransportKind, float] = MappingProxyType({SHM: 4e9, DIRECT: 1e9, STORE: 0.5e9})
"""Assumed bytes/s of a link no hand-off has measured yet, per transport (others: direct's):
a memory copy; about a 10 GbE NIC; two such hops."""
AUTO = (SHM, DIRECT, RECOMPUTE)
"""What the default settings let ``choose_transport`` pick from."""


@dataclass(frozen=True, slots=True)
class Link:
    """One link: ``bytes_per_s`` achievable (not line rate), ``latency_s`` per transfer."""

    bytes_per_s: float
    latency_s: float = LATENCY_S

    def transfer_time_s(self, num_bytes: int) -> float:
        """Seconds to move ``num_bytes``: latency + bytes / bandwidth; nothing to move, 0."""
        if num_bytes < 0:
            raise InvalidArgumentError("num_bytes", f"must be >= 0, got {num_bytes}")
        return self.latency_s + num_bytes / self.bytes_per_s if num_bytes else 0.0


@dataclass(frozen=True, slots=True)
class Handoff:
    """A hand-off's transport and its estimated seconds (moving the KV, or computing it)."""

    kind: TransportKind
    seconds: float


class Links:
    """What ``host`` believes of its links: per (peer host, case-insensitive; transport) an
    EWMA of measured bandwidth, else the prior. The first measurement of a link replaces the
    prior; later ones move it by ``alpha`` of the difference. ``measured``: published figures
    to start from, ``(peer host, transport, bytes/s)`` (unknown transports are skipped).
    ``modelled``: the figures are a model's (sim) and measurements do not move them."""

    def __init__(
        self,
        host: str,
        measured: Iterable[tuple[str, str, float]] = (),
        *,
        alpha: float = 0.25,
        modelled: bool = False,
    ) -> None:
        if not 0 < alpha <= 1:
            raise InvalidArgumentError("alpha", f"must be in (0, 1], got {alpha}")
        self.host, self.alpha, self.modelled = host, alpha, modelled
        kinds = {k.value: k for k in TransportKind}
        self._measured = {
            (peer.lower(), kinds[kind]): Link(bw) for peer, kind, bw in measured if kind in kinds
        }

    def link(self, peer: str, kind: TransportKind) -> Link:
        return self._measured.get((peer.lower(), kind)) or Link(PRIORS.get(kind, PRIORS[DIRECT]))

    def measure(self, peer: str, kind: TransportKind, num_bytes: int, seconds: float) -> Link:
        """Fold one transfer of ``num_bytes`` in ``seconds`` into the link; the link now."""
        if num_bytes <= 0:
            raise InvalidArgumentError("num_bytes", f"must be > 0, got {num_bytes}")
        if not seconds > 0:
            raise InvalidArgumentError("seconds", f"must be > 0, got {seconds}")
        if self.modelled:
            return self.link(peer, kind)
        # The latency is charged once per transfer, so it is taken out of each sample (else
        # small transfers would make the link look slow), down to a floor: a transfer faster
        # than the latency still counts as moving data.
        sample = num_bytes / max(seconds - LATENCY_S, seconds / 10)
        key = (peer.lower(), kind)
        old = self._measured.get(key)
        bw = sample if old is None else old.bytes_per_s + self.alpha * (sample - old.bytes_per_s)
        self._measured[key] = Link(bw)
        return self._measured[key]

    def observe(self, peer: str, record: HandoffRecord) -> None:
        """Fold one hand-off's record in (its busy time: the receiver's read, else the
        sender's); one that moved nothing is left out."""
        kind = TransportKind(record.transport)
        seconds = (record.recv_ms or record.busy_ns / 1e6) / 1e3
        if kind is not RECOMPUTE and record.num_bytes > 0 and seconds > 0:
            self.measure(peer, kind, record.num_bytes, seconds)

    def published(self) -> tuple[tuple[str, str, float], ...]:
        """The measured links, for heartbeats: ``(peer host, transport, bytes/s)``."""
        return tuple(
            (peer, k.value, link.bytes_per_s) for (peer, k), link in self._measured.items()
        )

    def timeout_s(self, peer: str, kind: TransportKind, num_bytes: int, configured: float) -> float:
        """``configured`` if set, else ``default_timeout_s`` from the link's bandwidth."""
        if configured > 0:
            return configured
        return default_timeout_s(num_bytes, self.link(peer, kind).bytes_per_s)


def allowed_transports(
    forced: TransportKind | None = None,
    *,
    network: TransportKind = DIRECT,
    allow_shm: bool = True,
    allow_recompute: bool = True,
) -> tuple[TransportKind, ...]:
    """What a prefill worker's settings let ``choose_transport`` pick from; ``network``:
    ``direct`` or ``store``, what a cross-host hand-off uses."""
    if forced is not None:
        return (forced,)
    return (*((SHM,) if allow_shm else ()), network, *((RECOMPUTE,) if allow_recompute else ()))


def choose_transport(
    links: Links,
    peer: str,
    num_tokens: int,
    kv_bytes: int,
    *,
    prefill_token_s: float,
    step_overhead_s: float = 0.0,
    allowed: Sequence[TransportKind] = AUTO,
) -> Handoff:
    """The transport of one hand-off from ``links.host`` to ``peer`` and its estimated time
    (see the module docstring for the rules). ``prefill_token_s``, ``step_overhead_s``: the
    prefill worker's step model (0: not measured)."""
    for name, value in zip(
        ("num_tokens", "kv_bytes", "prefill_token_s", "step_overhead_s"),
        (num_tokens, kv_bytes, prefill_token_s, step_overhead_s),
        strict=True,
    ):
        if not value >= 0:
            raise InvalidArgumentError(name, f"must be >= 0, got {value}")
    if not allowed:
        raise InvalidArgumentError("allowed", "must name at least one transport")
    recompute_s = step_overhead_s + num_tokens * prefill_token_s
    if len(allowed) == 1:  # forced
        kind = allowed[0]
    elif SHM in allowed and bool(links.host) and links.host.lower() == peer.lower():
        kind = SHM
    else:
        kind = DIRECT if DIRECT in allowed else STORE
        move_s = links.link(peer, kind).transfer_time_s(kv_bytes)
        if RECOMPUTE in allowed and prefill_token_s > 0 and move_s > recompute_s:
            kind = RECOMPUTE
    if kind is RECOMPUTE:
        return Handoff(kind, recompute_s)
    return Handoff(kind, links.link(peer, kind).transfer_time_s(kv_bytes))


def default_timeout_s(num_bytes: int, bytes_per_s: float) -> float:
    """``clamp(4 * expected + 0.5 s, 1 s, 5 s)``, expected = bytes / bandwidth.

    Generous against jitter, but bounded: past the ceiling, recomputing beats waiting.
    """
    if num_bytes < 0:
        raise InvalidArgumentError("num_bytes", f"must be >= 0, got {num_bytes}")
    if not bytes_per_s > 0:
        raise InvalidArgumentError("bytes_per_s", f"must be > 0, got {bytes_per_s}")
    expected = num_bytes / bytes_per_s
    return min(max(4.0 * expected + 0.5, 1.0), 5.0)
