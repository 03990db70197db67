"""A prefill worker's hand-off settings (``TransferOptions``), and how it picks the transport
of one request's KV (``TransportChooser.choose``):

1. A transport forced by the request (``PrefillRequest.transport``), else by the worker
   (``--transport``), is used as given; ``direct`` without a known decode worker goes through
   the store instead.
2. Nothing known about the decode worker (a caller that does not pass the scheduler's
   choice): ``store``.
3. Otherwise ``transfer.links.choose_transport``, the rule the scheduler prices placements by,
   on this host's ``Links`` (fed by each committed hand-off's busy time: the time the
   transport moved bytes) and this worker's step model: same host -> ``shm``; else the network
   transport (``direct`` by default), unless moving the KV would take longer than the decode
   worker computing it again (``recompute``; it runs the same model).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.step_meter import StepModel
from pdserve.errors import InvalidArgumentError
from pdserve.transfer.base import TransportKind
from pdserve.transfer.compress import Compression
from pdserve.transfer.faults import SendFaults
from pdserve.transfer.links import Links, allowed_transports, choose_transport

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

    @property
    def transports(self) -> tuple[TransportKind, ...]:
        """What the policy picks from (``transfer.links.allowed_transports``); heartbeats
        publish it, so that the scheduler prices the transport this worker will take."""
        return allowed_transports(
            parse_transport(self.transport),
            network=self.network,
            allow_shm=self.allow_shm,
            allow_recompute=self.allow_recompute,
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


class TransportChooser:
    """Picks the transport of each hand-off (see the module docstring), on what this host
    knows of its ``links``."""

    def __init__(self, links: Links, kv_bytes_per_token: int, options: TransferOptions) -> None:
        self.links = links
        self.kv_bytes_per_token = kv_bytes_per_token
        self.options = options

    def choose(
        self,
        num_tokens: int,
        steps: StepModel,
        *,
        decode_address: str = "",
        decode_host: str = "",
        forced: TransportKind | None = None,
    ) -> TransportKind:
        """``steps``: this worker's step model (what a recompute of the prompt costs)."""
        allowed = (forced,) if forced is not None else self.options.transports
        if not decode_address:  # nowhere to stream to: the store is the fallback
            allowed = tuple(
                TransportKind.STORE if k is TransportKind.DIRECT else k for k in allowed
            )
            if not decode_host and len(allowed) > 1:
                return TransportKind.STORE
        return choose_transport(
            self.links,
            decode_host,
            num_tokens,
            num_tokens * self.kv_bytes_per_token,
            prefill_token_s=steps.prefill_token_s,
            step_overhead_s=steps.overhead_s,
            allowed=allowed,
        ).kind
