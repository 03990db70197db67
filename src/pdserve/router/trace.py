"""``RequestTrace``: where one request is in its trace, and where its time went so far.

The flow (``flow``) speaks the protocol; this object keeps its stage bookkeeping: the root
span (``router.request``) every stage hangs under, the end of the last stage (handed to the
next call so that the stages tile the request, ``pdserve.telemetry.handover``), the mode
decision span, and the request's ``Timing`` as each worker's answer adds to it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from pdserve.router.downstream import DeadlineExceededError
from pdserve.router.request import RouteRequest
from pdserve.router.telemetry import ObservedRequest, name_mode, record_mode_decision
from pdserve.telemetry.handover import handing_over, stage_end_of
from pdserve.telemetry.metrics import RouterMetrics
from pdserve.timing import Timing
from pdserve.v1 import common_pb2, scheduler_pb2


class Clock:
    """The request's start time and the caller's deadline, on the monotonic clock."""

    def __init__(self, timeout_s: float | None) -> None:
        self.start = time.monotonic()
        self.deadline = None if timeout_s is None else self.start + timeout_s

    def elapsed_ms(self) -> float:
        return (time.monotonic() - self.start) * 1000.0

    def remaining(self, step: str) -> float | None:
        """Seconds left for the call named ``step``; DeadlineExceededError if none are."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(f"deadline exceeded before {step}")
        return left


@dataclass(slots=True)
class RequestTrace:
    """The stages and the timing of one request in the router."""

    clock: Clock
    root: trace.Span | None = None
    """``router.request``: the parent of every stage, handed to each call."""
    stage_end_ns: int | None = None
    """Unix ns where the last stage so far ended, handed to the next call."""
    arm: str = ""
    """The rollout arm the request was sent in ("" when no split is set)."""
    timing: Timing = field(default_factory=Timing)
    first_sent: bool = False
    metrics: RouterMetrics | None = None
    """The router's metrics, for what the flow counts itself (waits for the scheduler)."""

    @classmethod
    def of(cls, clock: Clock, observed: ObservedRequest | None) -> RequestTrace:
        """The trace of a request ``observed`` by the router's telemetry (None: no spans)."""
        if observed is None:
            return cls(clock)
        return cls(
            clock,
            root=observed.span,
            stage_end_ns=observed.accepted_ns,
            metrics=observed.metrics,
        )

    # -- stages --------------------------------------------------------------------------------

    @contextmanager
    def handing_over(self, start_ns: int | None = None) -> Iterator[None]:
        """Calls made in the ``with`` body start their stage where the last one ended (or at
        ``start_ns``), under the root stage."""
        with handing_over(start_ns or self.stage_end_ns or time.time_ns(), self.root):
            yield

    async def stage_ended(self, call: Any) -> None:
        """The call's answer came: its callee's last stage ended where its trailer says."""
        self.stage_end_ns = await stage_end_of(call)

    def mode_decided(
        self,
        asked_ns: int,
        asked: common_pb2.Mode,
        request: RouteRequest,
        assignment: scheduler_pb2.Assignment | None,
    ) -> None:
        """``router.mode_decision``: from the last stage's end to ``asked_ns``, the moment
        placement was asked for; ``assignment`` None when the request was not placed."""
        start = self.stage_end_ns or asked_ns
        record_mode_decision(self.root, start, asked_ns, asked, request, self.arm, assignment)

    def serving_mode(self, mode: common_pb2.Mode) -> None:
        """Name the mode the scheduler placed the request in on ``router.request``."""
        name_mode(self.root, mode)

    # -- timing --------------------------------------------------------------------------------

    def placed(self) -> None:
        """The scheduler placed the request: the time so far was queueing."""
        self.timing = dataclasses.replace(self.timing, queue_ms=self.clock.elapsed_ms())

    def prefilled(self, prefill: Timing) -> None:
        """A prefill worker answered with ``prefill`` (its queue adds to the router's)."""
        self.timing = dataclasses.replace(
            self.timing,
            queue_ms=self.timing.queue_ms + prefill.queue_ms,
            prefill_ms=prefill.prefill_ms,
            transfer_ms=prefill.transfer_ms,
            transfer_bytes=prefill.transfer_bytes,
            transport=prefill.transport,
        )

    def decoded(self, decode: Timing) -> None:
        """A decode worker's last chunk came with ``decode``."""
        self.timing = self.timing.after_decode(decode)

    def generated(self, worker: Timing) -> None:
        """A mixed worker's last chunk came with ``worker``."""
        self.timing = self.timing.after_generate(worker)

    def token_sent(self) -> None:
        """A chunk with tokens goes to the caller: the first one is the time to first token."""
        if not self.first_sent:
            self.first_sent = True
            self.timing = dataclasses.replace(self.timing, ttft_ms=self.clock.elapsed_ms())

    def finished(self) -> Timing:
        """The last chunk goes to the caller: the request's timing, end to end."""
        self.timing = dataclasses.replace(self.timing, e2e_ms=self.clock.elapsed_ms())
        return self.timing
