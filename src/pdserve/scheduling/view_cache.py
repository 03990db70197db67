"""The scheduler's cached view of the live workers (step 1 of ``scheduler.py``'s lifecycle).

Owns each live worker's ``WorkerView`` (heartbeat plus reserved amounts) as last read from
Redis, the single-flight refresh that renews it, and this replica's own commits and releases,
accounted in it at once. Apart from ``ClusterScheduler`` so that a decision's data, and how old
it may be, is one type: ``assign`` only reads it, and ``refresher`` keeps it fresh.
"""

from __future__ import annotations

import asyncio
import time

from pdserve.scheduling.capacity import Claim, WorkerView, stale
from pdserve.scheduling.prefix_index import PrefixIndex
from pdserve.scheduling.registry import RedisWorkerRegistry
from pdserve.scheduling.reservations import ReservationLedger


class ViewCache:
    """Live workers by id; a worker two heartbeats late is left out, even while its key lives
    on. ``prefix_index`` (if any) forgets the workers gone at each refresh."""

    def __init__(
        self,
        registry: RedisWorkerRegistry,
        ledger: ReservationLedger,
        prefix_index: PrefixIndex | None = None,
    ) -> None:
        self.registry, self.ledger, self.prefix_index = registry, ledger, prefix_index
        self.views: dict[str, WorkerView] = {}
        self.refreshed_at = -float("inf")
        """``time.monotonic()`` when the latest refresh started."""
        self._lock = asyncio.Lock()

    async def refresh(self, *, not_before: float) -> None:
        """Read the views from Redis unless a refresh started at ``not_before`` or later.
        Single flight: concurrent callers wait for one refresh instead of each doing one."""
        if self.refreshed_at >= not_before:
            return
        async with self._lock:
            if self.refreshed_at >= not_before:
                return
            started = time.monotonic()
            infos = await self.registry.list_workers()
            reserved, now_s = await self.ledger.reserved_on(infos)
            views = (WorkerView(i, reserved[i.id], max(0.0, now_s - i.ts)) for i in infos)
            self.views = {v.id: v for v in views if not stale(v)}
            if self.prefix_index is not None:
                self.prefix_index.forget(list(self.views))
            self.refreshed_at = started

    def account(self, worker_id: str, claim: Claim) -> None:
        """Add our own commit to the view so that the next decisions see it at once."""
        view = self.views.get(worker_id)
        if view is not None:
            self.views[worker_id] = view.with_reserved(view.reserved + claim)

    def unaccount(self, worker_id: str, claim: Claim) -> None:
        """Take a released claim off the view."""
        view = self.views.get(worker_id)
        if view is not None:
            self.views[worker_id] = view.with_reserved(view.reserved - claim)
