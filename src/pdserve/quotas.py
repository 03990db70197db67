"""Per-tenant quotas on reservations: how much of the cluster one tenant may hold at once.

A quota caps a tenant's live reservations (requests placed and not yet released) and the KV
blocks they reserve; 0 means no cap. The scheduler checks it inside the same optimistic
commit as the workers' capacity (``scheduling.reservations.ReservationLedger``), so replicas
sharing one Redis never let a tenant past it. A request over quota is refused
RESOURCE_EXHAUSTED with a message naming the quota (``QuotaExceededError``), before any
worker capacity is taken.

A module of its own, below both readers: the scheduler enforces quotas, and the API key file
(``security.apikeys``) gives them per tenant.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.errors import CapacityError, InvalidArgumentError


class QuotaExceededError(CapacityError):
    """A tenant's quota has no room for another reservation (RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """Caps of one tenant; 0: no cap."""

    max_reservations: int = 0
    max_kv_blocks: int = 0

    def __post_init__(self) -> None:
        for name in ("max_reservations", "max_kv_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(name, f"must be an integer >= 0, got {value!r}")

    @property
    def limited(self) -> bool:
        return bool(self.max_reservations or self.max_kv_blocks)

    def refusal(self, tenant: str, live: int, blocks: int, new_blocks: int) -> str | None:
        """Why one more reservation of ``new_blocks`` does not fit next to ``live``
        reservations holding ``blocks``; None if it does."""
        who = f"tenant {tenant!r}" if tenant else "the default tenant"
        if self.max_reservations and live + 1 > self.max_reservations:
            return (
                f"{who} is at its quota max_reservations={self.max_reservations} "
                f"({live} reservations live)"
            )
        if self.max_kv_blocks and blocks + new_blocks > self.max_kv_blocks:
            return (
                f"{who} would exceed its quota max_kv_blocks={self.max_kv_blocks} "
                f"({blocks} reserved, {new_blocks} asked)"
            )
        return None


@dataclass(frozen=True, slots=True)
class TenantQuotas:
    """The quota of every tenant: its own, else ``default``."""

    default: TenantQuota = field(default_factory=TenantQuota)
    per_tenant: Mapping[str, TenantQuota] = field(default_factory=dict)

    def of(self, tenant: str) -> TenantQuota:
        return self.per_tenant.get(tenant, self.default)
