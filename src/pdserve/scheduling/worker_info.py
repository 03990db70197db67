"""What a worker says about itself in each heartbeat.

Besides identity and load, a heartbeat carries what the scheduler's cost model needs
(``pdserve.scheduling.costmodel``), measured by the worker as it runs: its engine's step-time
model (``step_overhead_s``, ``decode_seq_s``, ``prefill_token_s``), how busy the engine is,
the bandwidth of the KV links it has used (``links``); and the transports it allows
(``transports``). What it serves right now (``serves``) can change while it runs: a planner
moves mixed workers between prefill and decode duty (``duty``, ``switching``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import MISSING, asdict, dataclass, fields
from enum import StrEnum
from typing import Any

from pdserve.errors import InvalidArgumentError
from pdserve.transfer.handle import TransportKind


class WorkerRole(StrEnum):
    """What a worker process does; the values are the JSON spelling."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"
    """Prefill and decode in one process (colocated mode)."""


PHASE_NAMES = ("prefill", "decode", "colocated")
"""The phases a worker can serve (``capacity.Phase`` values)."""

_PHASES_OF_ROLE = {
    WorkerRole.PREFILL: ("prefill",),
    WorkerRole.DECODE: ("decode",),
    WorkerRole.MIXED: ("decode", "colocated"),
}

LANES = ("any", "long", "short")
"""``any``: prompts of every length; ``long``/``short``: a dedicated prefill pool for prompts
above/below the scheduler's long-prompt threshold."""

DUTIES = ("", "prefill", "decode")
"""A mixed worker's duty under a planner: ``prefill`` (prefills only), ``decode`` (decode and
colocated requests), or ``""`` (everything it can serve)."""

_FLOAT_FIELDS = ("step_overhead_s", "decode_seq_s", "prefill_token_s", "busy")
_OPTIONAL_FLOAT_FIELDS = ("kv_bytes_per_s", "kv_peak_bytes_per_s")

_INT_FIELDS = (
    "kv_blocks_total",
    "kv_blocks_free",
    "block_size",
    "max_batch_tokens",
    "queued_tokens",
    "running_seqs",
    "waiting_decodes",
    "max_seqs",
    "kv_bytes_per_token",
    "interactive_tokens",
)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One heartbeat: a worker's identity, where to reach it, and its load right now.

    The load fields describe one instant; ``reservations`` lists the scheduler reservations whose
    resources that instant already includes (requests the worker has admitted), so that the
    scheduler does not subtract them a second time.
    """

    id: str
    role: WorkerRole
    address: str
    """host:port of the worker's gRPC server."""
    host: str
    """Host name, to tell whether a same-host KV transport is possible."""
    model_fingerprint: str
    """Identity of weights, dtype and cache layout; KV moves only between equal fingerprints."""
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    """Tokens per KV block."""
    max_batch_tokens: int
    """Tokens the worker computes in one forward step at most."""
    queued_tokens: int = 0
    """Prompt tokens admitted but not yet prefilled."""
    running_seqs: int = 0
    waiting_decodes: int = 0
    """Handed-over requests whose KV waits for a batch slot (prompts waiting to prefill are
    ``queued_tokens``)."""
    max_seqs: int = 0
    """Sequences one engine step carries at most (its batch slots); 0: unknown."""
    draining: bool = False
    """True once the worker finishes what it has and takes nothing new."""
    ts: float = 0.0
    """Unix time (seconds) at which the heartbeat was taken."""
    reservations: tuple[str, ...] = ()
    """Reservation ids already admitted, i.e. already counted in kv_blocks_free/queued_tokens."""
    interval_s: float = 0.0
    """Seconds between the worker's heartbeats: a heartbeat older than two of them means the
    worker is gone, before its key expires (0: unknown; only the key's expiry counts)."""
    serves: tuple[str, ...] = ()
    """Phases (``PHASE_NAMES``) the worker accepts new work for now; empty: those of its role
    (unless ``switching``: then none)."""
    lane: str = "any"
    """Prompt lengths whose prefill it takes (``LANES``)."""
    duty: str = ""
    """The duty a planner gave it (``DUTIES``); ``serves`` follows it once drained."""
    capabilities: tuple[str, ...] = ()
    """Phases it could serve under some duty; empty: those of its role."""
    switching: bool = False
    """Draining the work of its old duty before it takes that of ``duty``."""
    step_overhead_s: float = 0.0
    """Measured: an engine step's fixed cost (0: nothing measured yet)."""
    decode_seq_s: float = 0.0
    """Measured: what each decoding sequence adds to a step."""
    prefill_token_s: float = 0.0
    """Measured: what each prompt token adds to a step (0: no prefill measured yet)."""
    busy: float = 0.0
    """Measured: the share of recent time the engine spent in steps, 0..1."""
    links: tuple[tuple[str, str, float], ...] = ()
    """Measured KV hand-offs from this worker: ``(peer host, transport, bytes/s)``."""
    kv_bytes_per_token: int = 0
    """Bytes of KV one prompt token hands over (all layers); 0: unknown."""
    interactive_tokens: int = 0
    """The most prompt tokens a step may carry and still take a shared host's cores ahead of
    the other engines' bulk work (the host lease's bulk threshold, ``compute.lease``); a step
    carrying more waits behind their bulk steps, and so do the streams it decodes. 0: the
    worker's engine shares no cores."""
    transports: tuple[str, ...] = ()
    """The transports its hand-off policy picks from (``transfer.links.allowed_transports``),
    so that the scheduler prices the one it will take; empty: the default policy's."""
    kv_bytes_per_s: float | None = None
    """Measured: KV bytes/s its hand-offs moved over the last 10 s, all links together
    (``transfer.bandwidth``); None: not published (a worker without connectors, or an older
    one)."""
    kv_peak_bytes_per_s: float | None = None
    """Measured: the busiest 100 ms of those 10 s, bytes/s; None: not published."""
    kv_agent: str = ""
    """A prefill worker's NIXL agent and registered KV blocks (``transfer.nixl``'s
    ``AgentDescriptor``, encoded); "" without the nixl transport."""
    kv_agent_fingerprint: str = ""
    """The fingerprint of ``kv_agent``, which nixl handles name."""
    prefix_store: str = ""
    """The KV store it fetches prompt-prefix chunks from (``--prefix-reuse``), whose blocks the
    scheduler's prefix index counts for it too (``prefix_index``); empty: none."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id or any(c in self.id for c in " |{}"):
            raise InvalidArgumentError(
                "id", f"must be a non-empty name without ' |{{}}', got {self.id!r}"
            )
        try:
            object.__setattr__(self, "role", WorkerRole(self.role))
        except ValueError:
            allowed = ", ".join(r.value for r in WorkerRole)
            raise InvalidArgumentError(
                "role", f"must be one of {allowed}, got {self.role!r}"
            ) from None
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(name, f"must be an integer >= 0, got {value!r}")
        if self.block_size < 1:
            raise InvalidArgumentError("block_size", f"must be >= 1, got {self.block_size}")
        if self.kv_blocks_free > self.kv_blocks_total:
            raise InvalidArgumentError(
                "kv_blocks_free",
                f"{self.kv_blocks_free} exceeds kv_blocks_total {self.kv_blocks_total}",
            )
        for name in (
            "address", "host", "model_fingerprint", "kv_agent", "kv_agent_fingerprint",
            "prefix_store",
        ):  # fmt: skip
            if not isinstance(getattr(self, name), str):
                raise InvalidArgumentError(name, f"must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.draining, bool):
            raise InvalidArgumentError("draining", f"must be a bool, got {self.draining!r}")
        for name in ("ts", "interval_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidArgumentError(name, f"must be a number, got {value!r}")
        object.__setattr__(self, "reservations", tuple(self.reservations))
        if not all(isinstance(r, str) for r in self.reservations):
            raise InvalidArgumentError("reservations", "must be reservation id strings")
        self._check_scheduling_fields()

    def _check_scheduling_fields(self) -> None:
        for name in ("serves", "capabilities"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
            bad = [p for p in getattr(self, name) if p not in PHASE_NAMES]
            if bad:
                raise InvalidArgumentError(name, f"unknown phases {bad}; known: {PHASE_NAMES}")
        if self.lane not in LANES:
            raise InvalidArgumentError("lane", f"must be one of {LANES}, got {self.lane!r}")
        if self.duty not in DUTIES:
            raise InvalidArgumentError("duty", f"must be one of {DUTIES}, got {self.duty!r}")
        if not isinstance(self.switching, bool):
            raise InvalidArgumentError("switching", f"must be a bool, got {self.switching!r}")
        for name in _FLOAT_FIELDS + _OPTIONAL_FLOAT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FLOAT_FIELDS:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise InvalidArgumentError(name, f"must be a number >= 0, got {value!r}")
        try:
            links = tuple((str(h), str(t), float(bw)) for h, t, bw in self.links)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                "links", "must be [peer host, transport, bytes/s] triples"
            ) from None
        if any(not bw > 0 for _, _, bw in links):
            raise InvalidArgumentError("links", "bandwidths must be > 0")
        object.__setattr__(self, "links", links)
        object.__setattr__(self, "transports", tuple(self.transports))
        if not set(self.transports) <= {k.value for k in TransportKind}:
            raise InvalidArgumentError("transports", f"must name transports, got {self.transports}")

    @property
    def phases(self) -> tuple[str, ...]:
        """The phases it accepts new work for: ``serves``, else those of its role; none while
        it drains towards a new duty with nothing in common with the old one."""
        if self.serves or self.switching:
            return self.serves
        return _PHASES_OF_ROLE[self.role]

    @property
    def switchable(self) -> bool:
        """A planner can move it between prefill and decode duty."""
        can = self.capabilities or self.phases
        return self.role is WorkerRole.MIXED and "prefill" in can and "decode" in can

    def to_json(self) -> str:
        """Compact JSON with every field; ``from_json`` reads it back equal."""
        data = asdict(self)
        data["role"] = self.role.value
        data["reservations"] = list(self.reservations)
        data["serves"] = list(self.serves)
        data["capabilities"] = list(self.capabilities)
        data["links"] = [list(link) for link in self.links]
        data["transports"] = list(self.transports)
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, data: str | bytes) -> WorkerInfo:
        """Parse a heartbeat; unknown keys are ignored so that newer workers stay readable."""
        try:
            raw: Any = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InvalidArgumentError("heartbeat", f"not valid JSON: {err}") from err
        if not isinstance(raw, dict):
            raise InvalidArgumentError(
                "heartbeat", f"must be a JSON object, got {type(raw).__name__}"
            )
        known, required = _field_names()
        kwargs = {k: v for k, v in raw.items() if k in known}
        missing = [name for name in required if name not in kwargs]
        if missing:
            raise InvalidArgumentError("heartbeat", f"missing fields: {', '.join(missing)}")
        if not isinstance(kwargs.get("reservations", []), list):
            raise InvalidArgumentError("reservations", "must be a JSON list of reservation ids")
        kwargs["reservations"] = tuple(kwargs.get("reservations", ()))
        for name in ("serves", "capabilities", "links", "transports"):
            if not isinstance(kwargs.get(name, []), list):
                raise InvalidArgumentError(name, "must be a JSON list")
            kwargs[name] = tuple(kwargs.get(name, ()))
        return cls(**kwargs)


@functools.cache
def _field_names() -> tuple[frozenset[str], tuple[str, ...]]:
    """WorkerInfo's field names, and those without a default (computed once)."""
    fs = fields(WorkerInfo)
    required = tuple(f.name for f in fs if f.default is MISSING and f.default_factory is MISSING)
    return frozenset(f.name for f in fs), required
