"""What ``AsyncEngine`` does about failures: count them, and tell when the engine is lost.

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
import logging
import threading

from pdserve.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONSECUTIVE_FAILURES = 3
"""Failed steps in a row, none with any request progressing, after which the engine is lost."""


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
