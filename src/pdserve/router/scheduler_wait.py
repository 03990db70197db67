"""Calls to the scheduler that wait out its absence instead of failing the request.

A scheduler that restarts (killed, then brought back by ``pdserve up``'s supervisor) cannot be
reached for a few seconds. Every call the router makes to it (Assign, Release, Renew) goes
through ``SchedulerCalls.call``:

* A try that finds a replica unreachable (UNAVAILABLE, or a CANCELLED the router did not ask
  for, which ``downstream`` reports as UNAVAILABLE) goes at once to the next replica
  (``SchedulerReplicas.cycle``): with replicas, the death of one costs nothing.
* When every replica failed in a row, the call **waits**: it sleeps (exponential backoff with
  jitter, so that the requests that failed together do not come back together) and goes
  round again, for at most ``WaitPolicy.bound_s`` (``--scheduler-wait-s``, 10 s) from its
  first failure, and never past the request's deadline. Then it fails with the last error,
  which says how long it waited.
* A placement made after a worker failed the request (a retry from the start or a migration,
  ``failover``) also waits when the scheduler answers RESOURCE_EXHAUSTED: the request was
  admitted once, and its worker's death moved its load onto the survivors, whose queues are
  full for a moment. That is load to wait out, not a refusal to pass on. A first placement that
  finds the cluster full is refused at once: shedding new load is the caller's to decide.

Nothing else is retried: any other status would come back the same. UNAVAILABLE also covers
a scheduler that answers but has no live worker of a role (its Redis restarting, the only
worker of a role restarting): the call waits for that too.

A wait is a sleep in the request's own task, so a caller that cancels ends it at once, and
each one is recorded: a ``router.scheduler_wait`` event on the request's span (or the
release's) with its cause, time, tries and outcome; for placements also
``pdserve_router_scheduler_waiting`` (requests waiting now) and
``pdserve_router_scheduler_wait_seconds`` (time waited, by cause).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

import grpc
from opentelemetry import trace

from pdserve.errors import InvalidArgumentError, PdServeError
from pdserve.router.downstream import DownstreamError
from pdserve.router.schedulers import SchedulerReplicas
from pdserve.telemetry.metrics import RouterMetrics
from pdserve.telemetry.spans import (
    ATTR_WAIT_CAUSE,
    ATTR_WAIT_MS,
    ATTR_WAIT_OUTCOME,
    ATTR_WAIT_STEP,
    ATTR_WAIT_TRIES,
    ROUTER_SCHEDULER_WAIT,
)
from pdserve.v1 import scheduler_pb2_grpc

T = TypeVar("T")

DEFAULT_SCHEDULER_WAIT_S = 10.0
"""``--scheduler-wait-s``: longer than a supervised scheduler takes to come back."""


class WaitCause(StrEnum):
    """Why a call to the scheduler waits."""

    UNAVAILABLE = "unavailable"
    """No replica answered (or one answered that it has no live worker of a role)."""
    FULL = "full"
    """A placement after a failover found no room (RESOURCE_EXHAUSTED)."""


class WaitOutcome(StrEnum):
    """How a wait ended."""

    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class WaitPolicy:
    """How long, and at what pace, a call waits for a scheduler."""

    bound_s: float = DEFAULT_SCHEDULER_WAIT_S
    """Wait at most this long from the call's first failure (0: fail at once, as before)."""
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 0.5
    """A sleep's cap: a scheduler that is back is found within about this long."""
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not self.bound_s >= 0:
            raise InvalidArgumentError("scheduler_wait_s", f"must be >= 0, got {self.bound_s}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise InvalidArgumentError(
                "initial_backoff_s",
                f"must be > 0 and <= max_backoff_s ({self.max_backoff_s}), "
                f"got {self.initial_backoff_s}",
            )
        if not self.multiplier >= 1:
            raise InvalidArgumentError("multiplier", f"must be >= 1, got {self.multiplier}")

    def backoff_s(self, rounds: int) -> float:
        """The sleep after ``rounds`` (>= 1) failed rounds: half of the exponential step, plus
        a random part of the other half (callers that failed together spread out, and none
        comes back at once)."""
        step = self.max_backoff_s
        if self.multiplier == 1 or rounds - 1 < math.log(step / self.initial_backoff_s,
                                                          self.multiplier):  # fmt: skip
            # Below the cap; past it the power is never taken (it overflows a float after
            # about a thousand rounds of a long wait).
            step = min(step, self.initial_backoff_s * self.multiplier ** (rounds - 1))
        return step / 2 + random.uniform(0.0, step / 2)


def wait_cause(err: PdServeError, *, replacing: bool) -> WaitCause | None:
    """Why ``err`` of a scheduler call is worth waiting out, or None: it must be raised."""
    if not isinstance(err, DownstreamError):
        return None  # the caller's deadline, a bad answer: nothing to wait for
    if err.code is grpc.StatusCode.UNAVAILABLE:
        return WaitCause.UNAVAILABLE
    if replacing and err.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return WaitCause.FULL
    return None


Attempt = Callable[[scheduler_pb2_grpc.SchedulerStub], Awaitable[T]]
"""One try of a call on one replica's stub; raises ``PdServeError`` when it fails."""


class SchedulerCalls:
    """Every call of the router to the scheduler replicas (see the module docstring)."""

    def __init__(self, replicas: SchedulerReplicas, policy: WaitPolicy | None = None) -> None:
        self.replicas = replicas
        self.policy = policy or WaitPolicy()

    async def call(
        self,
        step: str,
        attempt: Attempt[T],
        *,
        deadline: float | None = None,
        replacing: bool = False,
        span: trace.Span | None = None,
        metrics: RouterMetrics | None = None,
    ) -> T:
        """``attempt`` on one replica after another until one answers; waits while none
        can (see the module docstring). ``deadline``: the request's, on the monotonic clock;
        ``replacing``: a placement after a failover (RESOURCE_EXHAUSTED is waited out);
        ``span`` gets the wait's event, ``metrics`` its figures."""
        wait = _Wait(self.policy, len(self.replicas), deadline, step, span, metrics)
        stubs = self.replicas.cycle()
        outcome = WaitOutcome.FAILED
        try:
            while True:
                try:
                    answer = await attempt(next(stubs))
                except PdServeError as err:
                    cause = wait_cause(err, replacing=replacing)
                    if cause is not None and await wait.again(cause):
                        continue
                    failure = wait.failure(err)
                    if failure is err:
                        raise
                    raise failure from err
                outcome = WaitOutcome.OK
                return answer
        except asyncio.CancelledError:
            outcome = WaitOutcome.CANCELLED
            raise
        finally:
            wait.ended(outcome)


class _Wait:
    """The tries and sleeps of one call."""

    def __init__(
        self,
        policy: WaitPolicy,
        replicas: int,
        deadline: float | None,
        step: str,
        span: trace.Span | None,
        metrics: RouterMetrics | None,
    ) -> None:
        self.policy = policy
        self.replicas = replicas
        self.deadline = deadline
        self.step = step
        self.span = span
        self.metrics = metrics
        self.tries = 0
        """Tries that failed."""
        self.failed_in_round = 0
        self.rounds = 0
        self.since: float | None = None
        """When the first sleep began (monotonic); None while the call has not waited."""
        self.cause = WaitCause.UNAVAILABLE

    async def again(self, cause: WaitCause) -> bool:
        """After a failed try: go on to the next replica at once, or sleep and go round
        again; False when the bound or the deadline leaves no time to."""
        self.tries += 1
        self.failed_in_round += 1
        if cause is WaitCause.UNAVAILABLE and self.failed_in_round < self.replicas:
            return True  # another replica may answer
        now = time.monotonic()
        since = now if self.since is None else self.since
        left = self.policy.bound_s - (now - since)
        if self.deadline is not None:
            left = min(left, self.deadline - now)
        if left <= 0:
            return False
        if self.since is None:
            self.since = now
            if self.metrics is not None:
                self.metrics.scheduler_wait_began()
        self.cause = cause
        self.rounds += 1
        # A backoff between tries, not synchronisation: nothing tells us the scheduler is back.
        await asyncio.sleep(min(left, self.policy.backoff_s(self.rounds)))
        self.failed_in_round = 0
        return True

    @property
    def waited_s(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    def failure(self, err: PdServeError) -> PdServeError:
        """``err`` as the caller gets it: saying how long the call waited, if it did."""
        if self.since is None or not isinstance(err, DownstreamError):
            return err
        return DownstreamError(
            err.step,
            err.code,
            f"{err.details}; still so after waiting {self.waited_s:.1f} s for the scheduler "
            f"({self.tries} tries; the router waits up to {self.policy.bound_s:g} s, "
            "--scheduler-wait-s)",
        )

    def ended(self, outcome: WaitOutcome) -> None:
        """Record the wait, if the call waited."""
        if self.since is None:
            return
        waited_s = self.waited_s
        if self.metrics is not None:
            self.metrics.scheduler_wait_ended(self.cause.value, waited_s)
        if self.span is not None:
            self.span.add_event(
                ROUTER_SCHEDULER_WAIT,
                {
                    ATTR_WAIT_STEP: self.step,
                    ATTR_WAIT_CAUSE: self.cause.value,
                    ATTR_WAIT_MS: waited_s * 1000.0,
                    ATTR_WAIT_TRIES: self.tries,
                    ATTR_WAIT_OUTCOME: outcome.value,
                },
            )
