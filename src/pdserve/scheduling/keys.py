"""The Redis key layout of the scheduling state, in one place.

With the default namespace ``pdserve``:

=================================  ======  ====================================================
key                                type    content
=================================  ======  ====================================================
``pdserve:worker:{worker_id}``     string  the worker's last heartbeat (WorkerInfo JSON), PX TTL
``pdserve:workers``                zset    worker_id -> unix time of its last heartbeat; an
                                           index to enumerate workers without SCAN
``pdserve:resv:{worker_id}``       zset    ``{reservation_id}|{tokens}|{blocks}`` -> expiry
                                           (Redis time, ms); what is reserved on the worker
``pdserve:reservation:{id}``       string  JSON record of one reservation (its zset members,
                                           the workers' addresses, tenant, creation time),
                                           PX TTL equal to the reservation's
``pdserve:tenant:{tenant}``        zset    ``{reservation_id}|{blocks}`` -> expiry: a tenant's
                                           live reservations (kept while it has a quota)
=================================  ======  ====================================================

A namespace lets several clusters (or tests) share one Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Builds the Redis keys of one cluster namespace."""

    namespace: str = "pdserve"

    def __post_init__(self) -> None:
        if not self.namespace or any(c.isspace() for c in self.namespace):
            raise InvalidArgumentError(
                "namespace", f"must be non-empty without spaces, got {self.namespace!r}"
            )

    def worker(self, worker_id: str) -> str:
        """Heartbeat key of one worker."""
        return f"{self.namespace}:worker:{worker_id}"

    @property
    def worker_index(self) -> str:
        """Sorted set of every worker id seen recently."""
        return f"{self.namespace}:workers"

    def reservations_on(self, worker_id: str) -> str:
        """Sorted set of the reservations held on one worker."""
        return f"{self.namespace}:resv:{worker_id}"

    def reservation(self, reservation_id: str) -> str:
        """Record of one reservation."""
        return f"{self.namespace}:reservation:{reservation_id}"

    def tenant_reservations(self, tenant: str) -> str:
        """Sorted set of one tenant's live reservations (``quotas``)."""
        return f"{self.namespace}:tenant:{tenant}"


def text(value: str | bytes) -> str:
    """Redis replies are bytes unless the client decodes them; accept both."""
    return value.decode() if isinstance(value, bytes) else value
