"""Ending a background task for certain.

``task.cancel(); await task`` hangs when a library swallows the cancellation: redis-py's pub/sub
read can (the task then waits on its next read, with the cancel consumed), and a service's
shutdown then never ends. ``cancel_and_wait`` cancels again until the task has ended.
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_S = 0.25
"""How long a cancelled task has to end before it is cancelled again."""


async def cancel_and_wait(task: asyncio.Task[Any], *, recancel_s: float = RECANCEL_S) -> None:
    """Cancel ``task`` (again every ``recancel_s`` while it runs on) and wait until it ends.

    Its own exception, if it ended with one other than the cancellation, is raised here.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=recancel_s)
    if not task.cancelled():
        task.result()
