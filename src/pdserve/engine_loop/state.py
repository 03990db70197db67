"""What ``AsyncEngine``'s engine thread publishes for other threads: its ``EngineSnapshot``
(load, admitted tags, failure counts) and, through ``FailureTracker``, its failures.

A step that fails some requests (``StepFailedError``) fails only those; the engine thread goes
on. ``FailureTracker`` counts such steps and requests, and decides when the engine cannot
continue: ``max_consecutive`` failed steps in a row in which no request progressed (one bad
request among healthy ones never counts). Any other exception of the engine thread also ends
it. Then ``failed()`` waiters (a worker turning its health NOT_SERVING) learn of it.

The engine thread writes; other threads read the counters (plain ints, each read atomic) or
wait on ``failed()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from dataclasses import dataclass, field

from pdserve.engine.outputs import EngineStats
from pdserve.engine.step_meter import StepModel
from pdserve.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONSECUTIVE_FAILURES = 3
"""Failed steps in a row, none with any request progressing, after which the engine is lost."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's state after a turn of its loop, readable from any thread."""

    stats: EngineStats
    tags: tuple[str, ...]
    """Tags (scheduler reservation ids) of the requests the engine has admitted."""
    num_steps: int
    """Engine steps run so far."""
    failed_steps: int = 0
    """Steps that failed some of their requests (the engine went on)."""
    failed_requests: int = 0
    """Requests those steps failed."""
    failed: bool = False
    """The engine thread stopped on a failure: it takes no more requests."""
    steps: StepModel = field(default_factory=StepModel)
    """The live step-time model (``engine.step_meter.StepMeter``)."""


def _resolve(future: asyncio.Future[BaseException], err: BaseException) -> None:
    if not future.done():  # its waiter may have been cancelled
        future.set_result(err)


class FailureTracker:
    """Failure counts of one engine thread, and its fatal failure once there is one."""

    def __init__(self, max_consecutive: int = DEFAULT_MAX_CONSECUTIVE_FAILURES) -> None:
        if max_consecutive < 1:
            raise InvalidArgumentError("max_consecutive", f"must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.failed_steps = 0
        """Steps that failed at least one request."""
        self.failed_requests = 0
        """Requests failed by a step."""
        self.consecutive = 0
        """Failed steps since the last step in which a request progressed."""
        self._lock = threading.Lock()
        self._fatal: BaseException | None = None
        self._waiters: list[asyncio.Future[BaseException]] = []

    @property
    def fatal(self) -> BaseException | None:
        """The failure that ended the engine thread, if one did."""
        return self._fatal

    def step_failed(self, num_failed: int, *, progressed: bool) -> bool:
        """Count a step that failed ``num_failed`` requests (``progressed``: others of it
        produced output); True when the engine should give up."""
        self.failed_steps += 1
        self.failed_requests += num_failed
        self.consecutive = 0 if progressed else self.consecutive + 1
        return self.consecutive >= self.max_consecutive

    def step_succeeded(self) -> None:
        self.consecutive = 0

    def snapshot(
        self,
        stats: EngineStats,
        tags: tuple[str, ...],
        num_steps: int,
        steps: StepModel | None = None,
    ) -> EngineSnapshot:
        """A snapshot of the engine with these counts."""
        return EngineSnapshot(
            stats,
            tags,
            num_steps,
            self.failed_steps,
            self.failed_requests,
            steps=steps or StepModel(),
        )

    def lost(self, last: EngineSnapshot) -> EngineSnapshot:
        """The final snapshot of an engine that failed for good: its last stats (its state is
        unknown now), no request admitted, ``failed``."""
        return dataclasses.replace(
            last,
            tags=(),
            failed_steps=self.failed_steps,
            failed_requests=self.failed_requests,
            failed=True,
        )

    def set_fatal(self, err: BaseException) -> None:
        """The engine thread ends on ``err``: wake every ``failed()`` waiter."""
        with self._lock:
            self._fatal = err
            waiters, self._waiters = self._waiters, []
        for future in waiters:
            try:
                future.get_loop().call_soon_threadsafe(_resolve, future, err)
            except RuntimeError:  # that loop is closed: its waiter is gone
                logger.debug("a waiter of the engine's failure left with its event loop")

    async def failed(self) -> BaseException:
        """Wait for the fatal failure (forever if the engine never has one); returns it."""
        future: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._fatal is not None:
                return self._fatal
            self._waiters.append(future)
        try:
            return await future
        finally:
            with self._lock:
                if future in self._waiters:
                    self._waiters.remove(future)
