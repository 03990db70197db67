"""What one hand-off will do, decided once before the prefill runs: ``HandoffPlan``, made by
``PrefillConnector.plan`` from the scheduler's decision (the decode worker the request's
reservation holds) and a prefill worker's settings (``TransferOptions``).

The transport (``choose_kind``):

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

A backend whose KV cannot leave its engine as bytes (TensorRT-LLM) hands over ``native``ly
(its engine keeps the KV for its own transfer; the handle carries the engine's ``NativeKV``)
or, asked for it, by ``recompute``; pdserve's transports are refused for it, naming the field
(``in_engine_kind``). A backend with no native transfer refuses ``native``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.backends import EngineBackend
from pdserve.engine.step_meter import StepModel
from pdserve.errors import InvalidArgumentError
from pdserve.transfer.base import TransportKind
from pdserve.transfer.compress import Compression
from pdserve.transfer.faults import SendFaults
from pdserve.transfer.links import Links, allowed_transports, choose_transport

AUTO = "auto"
TRANSPORT_CHOICES = (AUTO, *(k.value for k in TransportKind))
MOVING = (TransportKind.STORE, TransportKind.DIRECT, TransportKind.SHM, TransportKind.NIXL)
"""The transports that move the KV's bytes through pdserve."""
NIXL_POOL_BYTES = 256 * 1024 * 1024
"""The NIXL block pool of a worker with ``--transport nixl`` and no ``--nixl-pool-bytes``."""


@dataclass(frozen=True, slots=True)
class HandoffRoute:
    """Where the scheduler sends one prefill's KV (``PrefillRequest``'s hand-off fields): the
    decode worker it reserved ("" for none known) and the transport asked for."""

    decode_address: str = ""
    decode_host: str = ""
    transport: str = ""
    """"" or ``auto``: the policy's; else a forced transport (``TRANSPORT_CHOICES``)."""


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
    """Announce layer-wise store/shm/nixl hand-offs to the decode worker as they begin."""
    prefetch_min_bytes: int = 4 * 1024 * 1024
    """Smaller payloads are not announced: an announcement (one more RPC, a reader following
    the writer) costs about a millisecond here, more than reading 4 MiB takes after the fact."""
    timeout_s: float = 0.0
    """Bound on a commit (sender) or a read (receiver); 0: from payload size and bandwidth."""
    lease_s: float = 60.0
    """Lease of a hand-off entry whose reader never comes."""
    shm_slot_bytes: int = 0
    """``/dev/shm`` bytes of reused shm segments (``transfer.shm.slots``); 0: none."""
    nixl_pool_bytes: int = 0
    """nixl: bytes of KV blocks registered with the NIXL agent at start (``transfer.nixl``);
    0: ``NIXL_POOL_BYTES`` with ``--transport nixl``, else no pool (a request that asks for
    nixl is then refused). A hand-off that does not fit in what is free is recomputed."""
    nixl_block_bytes: int = 64 * 1024
    """nixl: bytes of one block (a multiple of 4096)."""
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
        if 0 < self.nixl_pool_bytes < self.nixl_block_bytes:
            raise InvalidArgumentError(
                "nixl_pool_bytes", f"must hold one block of {self.nixl_block_bytes} bytes"
            )
        if self.nixl_block_bytes < 4096 or self.nixl_block_bytes % 4096:
            raise InvalidArgumentError(
                "nixl_block_bytes", f"must be a multiple of 4096, got {self.nixl_block_bytes}"
            )
        if self.prefetch_min_bytes < 0:
            raise InvalidArgumentError(
                "prefetch_min_bytes", f"must be >= 0, got {self.prefetch_min_bytes}"
            )

    @property
    def nixl_pool(self) -> int:
        """Bytes of the NIXL block pool the worker registers at start (0: none)."""
        if self.nixl_pool_bytes:
            return self.nixl_pool_bytes
        return NIXL_POOL_BYTES if TransportKind.NIXL in self.transports else 0

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
        (``handoff.prefetch``): a layer-wise ``store``, ``shm`` or ``nixl`` one, to a known
        decode worker, of a request that will make a Decode call (``max_tokens`` > 1), of at
        least ``prefetch_min_bytes`` (a smaller one is read faster than an announcement
        costs)."""
        return (
            self.prefetch
            and self.layerwise
            and kind in (TransportKind.STORE, TransportKind.SHM, TransportKind.NIXL)
            and bool(decode_address)
            and max_tokens > 1
            and kv_bytes >= self.prefetch_min_bytes
        )


@dataclass(frozen=True, slots=True)
class HandoffPlan:
    """One hand-off as decided before the prefill runs; the prefill connector carries it out
    (``PrefillConnector.open``)."""

    request_id: str
    num_tokens: int
    """The prompt's tokens."""
    kind: TransportKind
    decode_address: str = ""
    """The decode worker's address: the scheduler's, if its reservation holds it; "" when
    none is known (or it was not the reservation's)."""
    decode_host: str = ""
    decodes: bool = True
    """A Decode call will follow (the first token cannot end the request by length)."""
    layerwise: bool = True
    """Layers leave as the engine makes them (False: all at the commit, the baseline)."""
    compression: Compression = Compression.NONE
    """How the layers travel (``none`` for shm)."""
    prefix_tokens: int = 0
    """Leading prompt tokens the decode worker caches (``prefix.decode``): not sent."""
    announce: bool = False
    """Tell the decode worker as the hand-off begins (``Decode.Prefetch``)."""
    timeout_s: float = 0.0
    """Bound on the commit; 0: from the payload's size and the link's bandwidth."""
    reason: str = ""
    """recompute: why nothing moves."""

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise InvalidArgumentError("num_tokens", f"must be >= 1, got {self.num_tokens}")
        if not 0 <= self.prefix_tokens < self.num_tokens:
            raise InvalidArgumentError(
                "prefix_tokens", f"{self.prefix_tokens} leaves nothing of {self.num_tokens} tokens"
            )

    @property
    def peer(self) -> str:
        """The link's far end: the decode worker's host, else its address."""
        return self.decode_host or self.decode_address

    @property
    def moves(self) -> bool:
        """Whether pdserve's transports move the KV (else recompute or native)."""
        return self.kind in MOVING

    def fall_back(self, reason: str) -> HandoffPlan:
        """The same request, recomputed on the decode worker instead."""
        return dataclasses.replace(
            self, kind=TransportKind.RECOMPUTE, reason=reason, prefix_tokens=0, announce=False
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


def choose_kind(
    options: TransferOptions,
    links: Links,
    num_tokens: int,
    kv_bytes: int,
    steps: StepModel,
    *,
    decode_address: str = "",
    decode_host: str = "",
    forced: TransportKind | None = None,
) -> TransportKind:
    """The transport of one hand-off (the module docstring's rules), on what this host knows
    of its ``links``; ``steps``: this worker's step model (what a recompute costs)."""
    allowed = (forced,) if forced is not None else options.transports
    if not decode_address:  # nowhere to stream to: the store is the fallback
        allowed = tuple(TransportKind.STORE if k is TransportKind.DIRECT else k for k in allowed)
        if not decode_host and len(allowed) > 1:
            return TransportKind.STORE
    return choose_transport(
        links,
        decode_host,
        num_tokens,
        kv_bytes,
        prefill_token_s=steps.prefill_token_s,
        step_overhead_s=steps.overhead_s,
        allowed=allowed,
    ).kind


def in_engine_kind(backend: EngineBackend, asked: TransportKind | None) -> TransportKind | None:
    """The kind of a hand-off the engine makes (native, or recompute on a backend whose KV
    cannot leave it); None: pdserve's transports carry the KV. ``asked``: the transport the
    request or the worker's options name (None: auto)."""
    f = backend.features
    if asked is TransportKind.NATIVE and not f.native_kv:
        raise InvalidArgumentError(
            "transport", f"the {backend.name} backend has no native KV transfer"
        )
    if f.kv_payload and asked is not TransportKind.NATIVE:
        return None
    if asked in (None, TransportKind.NATIVE, TransportKind.RECOMPUTE):
        return asked or TransportKind.NATIVE
    raise InvalidArgumentError(
        "transport",
        f"the {backend.name} backend's KV cannot leave its engine as bytes, so {asked} cannot "
        "carry it: use native (or recompute)",
    )
