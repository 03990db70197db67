"""What a worker says about itself in each heartbeat."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from enum import StrEnum
from typing import Any

from pdserve.errors import InvalidArgumentError


class WorkerRole(StrEnum):
    """What a worker process does; the values are the JSON spelling."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"
    """Prefill and decode in one process (colocated mode)."""


_INT_FIELDS = (
    "kv_blocks_total",
    "kv_blocks_free",
    "block_size",
    "max_batch_tokens",
    "queued_tokens",
    "running_seqs",
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
    draining: bool = False
    """True once the worker finishes what it has and takes nothing new."""
    ts: float = 0.0
    """Unix time (seconds) at which the heartbeat was taken."""
    reservations: tuple[str, ...] = ()
    """Reservation ids already admitted, i.e. already counted in kv_blocks_free/queued_tokens."""
    interval_s: float = 0.0
    """Seconds between the worker's heartbeats: a heartbeat older than two of them means the
    worker is gone, before its key expires (0: unknown; only the key's expiry counts)."""

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
        for name in ("address", "host", "model_fingerprint"):
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

    def to_json(self) -> str:
        """Compact JSON with every field; ``from_json`` reads it back equal."""
        data = asdict(self)
        data["role"] = self.role.value
        data["reservations"] = list(self.reservations)
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
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known}
        missing = [name for name in _required_fields() if name not in kwargs]
        if missing:
            raise InvalidArgumentError("heartbeat", f"missing fields: {', '.join(missing)}")
        if not isinstance(kwargs.get("reservations", []), list):
            raise InvalidArgumentError("reservations", "must be a JSON list of reservation ids")
        kwargs["reservations"] = tuple(kwargs.get("reservations", ()))
        return cls(**kwargs)


def _required_fields() -> list[str]:
    return [f.name for f in fields(WorkerInfo) if f.default is MISSING]
