"""The prefill batching window of an ``AsyncEngine``: how long an idle engine waits for more
requests before its first step.

When a request arrives at an idle engine, the engine thread keeps taking commands for up to
``window_ms``, or until the queued prompt tokens reach the step's token budget or the waiting
requests reach ``max_num_seqs``, whichever comes first: requests arriving together are then
prefilled in one step instead of the first one running alone. While the engine is busy, new
requests simply join the next step (continuous batching), so the window costs nothing under
load.

``adaptive`` (the default): the window only opens once requests have been seen arriving
together (a moving average of requests per arrival burst above one). One-at-a-time traffic
has no companion to wait for, and waiting would be pure added latency.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

from pdserve.engine_loop.commands import Command
from pdserve.errors import InvalidArgumentError

_EWMA_WEIGHT = 0.3
"""Weight of the latest burst in the moving average of requests per burst."""
_BURSTY = 1.05
"""Requests per burst, on average, above which arrivals count as coming together."""


class BatchWindow:
    """The window's policy and its wait; used by the engine thread only."""

    def __init__(self, window_ms: float, *, adaptive: bool = True) -> None:
        if not window_ms >= 0:
            raise InvalidArgumentError("batch_window_ms", f"must be >= 0, got {window_ms}")
        self.window_s = window_ms / 1000.0
        self.adaptive = adaptive
        self._adds = 0  # requests added since the last step
        self._burst_ewma = 1.0  # requests per arrival burst, moving average

    def added(self) -> None:
        """A request was added to the engine."""
        self._adds += 1

    def stepped(self) -> None:
        """The engine is about to step: the requests added since the last one were a burst."""
        if self._adds:
            self._burst_ewma = (1 - _EWMA_WEIGHT) * self._burst_ewma + _EWMA_WEIGHT * self._adds
            self._adds = 0

    @property
    def opens(self) -> bool:
        """Whether work arriving at an idle engine waits for companions."""
        return self.window_s > 0 and (not self.adaptive or self._burst_ewma > _BURSTY)

    def gather(
        self,
        commands: queue.SimpleQueue[Command],
        apply: Callable[[Command], bool],
        full: Callable[[], bool],
    ) -> bool:
        """Apply commands as they come for up to the window, or until ``full()`` (the step's
        budget is reached); False if a command said stop."""
        deadline = time.monotonic() + self.window_s
        while not full():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            try:
                command = commands.get(timeout=remaining)
            except queue.Empty:
                return True
            if not apply(command):
                return False
        return True
