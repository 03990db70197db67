"""Keeps a ``ClusterScheduler``'s cached view of the workers fresh in the background.

``assign`` decides from a cached view at most ``refresh_interval_s`` old, and refreshes it
itself when it is older: the refresh's Redis round trips (listing the heartbeats, summing the
live reservations) then come before the decision, on the request's critical path. With
requests a few hundred milliseconds apart that is a good share of them. Inside ``kept_fresh``
a task refreshes the view every half interval instead, so that ``assign`` finds it fresh and
its only Redis round trips are the optimistic re-check and the commit.

While Redis is unreachable the task logs once and keeps trying; ``assign`` reports the outage
to its callers (UNAVAILABLE) as before. ``on_reachable`` hears of each change (the first
refresh's outcome included), so that the service's health can say NOT_SERVING while the
scheduler cannot place anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from redis.exceptions import RedisError

from pdserve.scheduling.scheduler import ClusterScheduler
from pdserve.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


Reachable = Callable[[bool], Awaitable[None]]
"""Told whether Redis answered, whenever that changes."""


@contextlib.asynccontextmanager
async def kept_fresh(
    scheduler: ClusterScheduler,
    *,
    on_reachable: Reachable | None = None,
) -> AsyncIterator[None]:
    """Refresh ``scheduler``'s view every half its ``refresh_interval_s`` while inside; the
    task is cancelled and awaited on the way out. A period of 0 (a scheduler that refreshes
    for every decision) starts no task."""
    period = scheduler.refresh_interval_s / 2
    if not period > 0:
        yield
        return
    task = asyncio.create_task(
        _refresh_every(scheduler, period, on_reachable), name="scheduler-view-refresh"
    )
    try:
        yield
    finally:
        await cancel_and_wait(task)


async def _refresh_every(
    scheduler: ClusterScheduler, period_s: float, on_reachable: Reachable | None
) -> None:
    failing: bool | None = None  # unknown until the first refresh
    while True:
        try:
            await scheduler.refresh()
        except (RedisError, OSError) as err:  # assign reports an outage to its callers
            if failing is not True:
                logger.warning(
                    "cannot refresh the scheduler's view of the workers: %r (retrying every "
                    "%.3g s)", err, period_s,
                )  # fmt: skip
                if on_reachable is not None:
                    await on_reachable(False)
            failing = True
        else:
            if failing is not False:
                if failing:
                    logger.info("the scheduler's view of the workers is refreshed again")
                if on_reachable is not None:
                    await on_reachable(True)
            failing = False
        await asyncio.sleep(period_s)
