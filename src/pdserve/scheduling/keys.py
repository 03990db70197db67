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
                                           the workers' addresses, tenant, creation time,
                                           request id), PX TTL equal to the reservation's
``pdserve:tenant:{tenant}``        zset    ``{reservation_id}|{blocks}`` -> expiry: a tenant's
                                           live reservations (kept while it has a quota)
``pdserve:kvevents``               stream  prefix-cache changes of every worker (``kv_events``)
``pdserve:duty:{worker_id}``       string  the duty a planner gives a mixed worker
``pdserve:planner:leader``         string  id of the planner replica that leads, PX TTL
``pdserve:rollout``                string  the routers' traffic split (``router.rollout``)
``pdserve:rollout:changed``        pubsub  a message whenever the split changes
``pdserve:capture``                string  the routers' traffic capture while it is on
                                           (``router.capture``, JSON), EX TTL
``pdserve:capture:records``        stream  the captured requests' records (capped)
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

    @property
    def kv_events(self) -> str:
        """Stream of the workers' prefix-cache changes."""
        return f"{self.namespace}:kvevents"

    def duty(self, worker_id: str) -> str:
        """The duty a planner set for one mixed worker."""
        return f"{self.namespace}:duty:{worker_id}"

    @property
    def planner_leader(self) -> str:
        """Lease of the leading planner replica."""
        return f"{self.namespace}:planner:leader"

    @property
    def refused(self) -> str:
        """Hash of requests the schedulers refused for want of capacity, by phase (a
        counter the planner reads: load shed is demand no worker's queue shows)."""
        return f"{self.namespace}:refused"

    @property
    def rollout(self) -> str:
        """The routers' traffic split between serving modes."""
        return f"{self.namespace}:rollout"

    @property
    def rollout_channel(self) -> str:
        """Pub/sub channel announcing a change of ``rollout``."""
        return f"{self.namespace}:rollout:changed"

    @property
    def capture(self) -> str:
        """The routers' traffic capture setting, present while a capture runs."""
        return f"{self.namespace}:capture"

    @property
    def capture_stream(self) -> str:
        """Stream of the records of captured requests (``router.capture``)."""
        return f"{self.namespace}:capture:records"


def text(value: str | bytes) -> str:
    """Redis replies are bytes unless the client decodes them; accept both."""
    return value.decode() if isinstance(value, bytes) else value
