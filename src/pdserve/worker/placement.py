"""How a prefill worker moves one request's KV: the transport, its timeout, and what it
learns from each hand-off.

``TransportChooser.choose`` for one request:

1. A transport forced by the request (``PrefillRequest.transport``), else by the worker
   (``--transport``), is used as given; ``direct`` without a known decode worker goes through
   the store instead.
2. Nothing known about the decode worker (a caller that does not pass the scheduler's
   choice): ``store``.
3. Otherwise ``pdserve.transfer.policy.choose_transport``: same host -> ``shm``; else the
   network transport (``direct`` by default), unless moving the KV is estimated to take longer
   than the decode worker computing it again (``recompute``). Recompute is considered only once
   this worker has measured its own prefill throughput (the decode worker runs the same model).

Bandwidth estimates (``LinkEstimates``) are fed by every committed hand-off with its busy time
(the time the transport moved bytes; waits for the compute excluded), so that
``default_timeout_s`` and the recompute comparison follow what the link does.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv_payload import KVLayout
from pdserve.errors import InvalidArgumentError
from pdserve.transfer.base import HandoffRecord, TransportKind
from pdserve.transfer.compress import Compression
from pdserve.transfer.faults import SendFaults
from pdserve.transfer.policy import LinkEstimates, choose_transport, default_timeout_s

AUTO = "auto"
TRANSPORT_CHOICES = (AUTO, *(k.value for k in TransportKind))


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """A prefill worker's hand-off settings (``--transport`` and friends)."""

    transport: str = AUTO
    """``auto`` (the policy) or a forced ``store``/``direct``/``shm``/``recompute``."""
    network: TransportKind = TransportKind.DIRECT
    """What a cross-host hand-off uses when the decode worker is known."""
    allow_shm: bool = True
    allow_recompute: bool = True
    compression: Compression = Compression.NONE
    layerwise: bool = True
    """Send layers as the engine produces them (False: all at the end, the no-overlap baseline)."""
    decode_prefix: bool = True
    """Ask the decode worker which leading blocks it caches and send only the rest."""
    prefetch: bool = True
    """Announce layer-wise store/shm hand-offs to the decode worker as they begin."""
    prefetch_min_bytes: int = 4 * 1024 * 1024
    """Smaller payloads are not announced: an announcement (one more RPC, a reader following
    the writer) costs about a millisecond here, more than reading 4 MiB takes after the fact."""
    timeout_s: float = 0.0
    """Bound on a commit (sender) or a read (receiver); 0: from payload size and bandwidth."""
    lease_s: float = 60.0
    """Lease of a hand-off entry whose reader never comes."""
    shm_slot_bytes: int = 0
    """``/dev/shm`` bytes of reused shm segments (``transfer.shm.slots``); 0: none."""
    faults: SendFaults | None = None
    """Fault injection, for fault tests only."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORT_CHOICES:
            raise InvalidArgumentError(
                "transport", f"must be one of {TRANSPORT_CHOICES}, got {self.transport!r}"
            )
        if self.network not in (TransportKind.DIRECT, TransportKind.STORE):
            raise InvalidArgumentError("network", f"must be direct or store, got {self.network}")
        if not self.timeout_s >= 0:
            raise InvalidArgumentError("timeout_s", f"must be >= 0, got {self.timeout_s}")
        if not self.lease_s > 0:
            raise InvalidArgumentError("lease_s", f"must be > 0, got {self.lease_s}")
        if self.shm_slot_bytes < 0:
            raise InvalidArgumentError("shm_slot_bytes", f"must be >= 0, got {self.shm_slot_bytes}")
        if self.prefetch_min_bytes < 0:
            raise InvalidArgumentError(
                "prefetch_min_bytes", f"must be >= 0, got {self.prefetch_min_bytes}"
            )

    def announces(
        self, kind: TransportKind, *, decode_address: str, kv_bytes: int, max_tokens: int
    ) -> bool:
        """Whether a hand-off is announced to its decode worker as it begins
        (``worker.announce``): a layer-wise ``store`` or ``shm`` one, to a known decode worker,
        of a request that will make a Decode call (``max_tokens`` > 1), of at least
        ``prefetch_min_bytes`` (a smaller one is read faster than an announcement costs)."""
        return (
            self.prefetch
            and self.layerwise
            and kind in (TransportKind.STORE, TransportKind.SHM)
            and bool(decode_address)
            and max_tokens > 1
            and kv_bytes >= self.prefetch_min_bytes
        )


def parse_transport(value: str, *, field: str = "transport") -> TransportKind | None:
    """``""``/``auto`` -> None (let the policy choose), else the named transport."""
    if value in ("", AUTO):
        return None
    try:
        return TransportKind(value)
    except ValueError:
        raise InvalidArgumentError(
            field, f"must be one of {TRANSPORT_CHOICES}, got {value!r}"
        ) from None


class LinkModel:
    """Measured bandwidth per link and this worker's prefill throughput (EWMAs)."""

    def __init__(self, host: str, *, alpha: float = 0.25) -> None:
        self.host = host
        self.links = LinkEstimates(alpha=alpha)
        self.alpha = alpha
        self.prefill_tokens_per_s: float | None = None

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """One prefill computed ``num_tokens`` in ``seconds``."""
        if num_tokens <= 0 or not seconds > 0:
            return
        rate = num_tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else old + self.alpha * (rate - old)

    def observe(self, peer: str, record: HandoffRecord) -> None:
        """Fold one measured hand-off into the estimate of its link."""
        kind = TransportKind(record.transport)
        if kind is TransportKind.RECOMPUTE or record.num_bytes <= 0:
            return
        seconds = (record.recv_ms or record.busy_ns / 1e6) / 1e3
        if seconds > 0:
            self.links.observe(self.host, peer, kind, record.num_bytes, seconds)

    def published(self) -> tuple[tuple[str, str, float], ...]:
        """The links measured from this host, for heartbeats: ``(peer, transport, bytes/s)``."""
        return tuple(
            (dst, kind.value, est.bytes_per_s)
            for src, dst, kind, est in self.links.measured()
            if src == self.host
        )

    def timeout_s(self, peer: str, kind: TransportKind, num_bytes: int, configured: float) -> float:
        """``configured`` if set, else ``default_timeout_s`` from the link's bandwidth."""
        if configured > 0:
            return configured
        estimate = self.links.estimate(self.host, peer, kind)
        return default_timeout_s(num_bytes, estimate.bytes_per_s)


class TransportChooser:
    """Picks the transport of each hand-off (see the module docstring)."""

    def __init__(self, host: str, layout: KVLayout, options: TransferOptions) -> None:
        self.host = host
        self.layout = layout
        self.options = options
        self.model = LinkModel(host)

    def kv_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.layout.num_layers * self.layout.bytes_per_token_per_layer

    def choose(
        self,
        num_tokens: int,
        *,
        decode_address: str = "",
        decode_host: str = "",
        forced: TransportKind | None = None,
    ) -> TransportKind:
        o = self.options
        kind = forced or parse_transport(o.transport)
        if kind is not None:
            if kind is TransportKind.DIRECT and not decode_address:
                return TransportKind.STORE  # nowhere to stream to: the store is the fallback
            return kind
        if not (decode_address or decode_host):
            return TransportKind.STORE
        rate = self.model.prefill_tokens_per_s
        return choose_transport(
            self.host,
            decode_host,
            num_tokens,
            self.kv_bytes(num_tokens),
            self.model.links,
            rate or 1.0,
            network=o.network if decode_address else TransportKind.STORE,
            allow_shm=o.allow_shm,
            allow_recompute=o.allow_recompute and rate is not None,
        )
