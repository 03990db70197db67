"""The Scheduler gRPC service: translates pdserve.v1 messages to ClusterScheduler calls.

``Assign`` is the ``scheduler.assign`` stage span (policy, candidate workers, optimistic-check
retries, the chosen workers, the mode and why) and one ``pdserve_scheduler_decisions_total``
count by outcome (``slo`` for a request refused by admission), and one
``pdserve_scheduler_mode_decisions_total`` count by mode and reason;
the scheduler's own conflict counter (commits aborted by a concurrent writer) is exported as
``pdserve_scheduler_conflicts_total``, and every call failing on Redis counts one
``pdserve_redis_errors_total`` under its operation name.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, TypeAlias

from grpc.aio import ServicerContext
from redis.exceptions import RedisError

from pdserve.adapters.scheduler import (
    assignment_to_proto,
    mode_of,
    reservation_id_of,
    role_filter,
    worker_status,
)
from pdserve.errors import CapacityError, InvalidArgumentError, WorkerUnavailableError
from pdserve.quotas import QuotaExceededError
from pdserve.scheduling.capacity import Phase, WorkerView, ineligibility
from pdserve.scheduling.scheduler import ClusterScheduler, Mode, SloRefusalError
from pdserve.telemetry import handover, tracing
from pdserve.telemetry.metrics import SchedulerMetrics
from pdserve.telemetry.spans import (
    ATTR_CANDIDATES,
    ATTR_DECODE_WORKER,
    ATTR_MODE,
    ATTR_MODE_REASON,
    ATTR_POLICY,
    ATTR_PREFILL_WORKER,
    ATTR_RETRIES,
    SCHEDULER_ASSIGN,
)
from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc

Context: TypeAlias = ServicerContext[Any, Any]


def _redis_failure(err: BaseException) -> bool:
    """A Redis error, or a pdserve error raised because of one (Redis unreachable)."""
    return isinstance(err, RedisError) or isinstance(err.__cause__, RedisError)


def _outcome(err: BaseException) -> str:
    if isinstance(err, QuotaExceededError):
        return "quota"
    if isinstance(err, SloRefusalError):
        return "slo"
    if isinstance(err, CapacityError):
        return "no_capacity"
    if isinstance(err, WorkerUnavailableError):
        return "unavailable"
    if isinstance(err, InvalidArgumentError):
        return "invalid"
    return "error"


def _candidates(views: list[WorkerView], mode: Mode) -> int:
    """Live, non-draining workers of the roles ``mode`` needs (before any load check)."""
    phases = {
        Mode.COLOCATED: (Phase.COLOCATED,),
        Mode.DISAGGREGATED: (Phase.PREFILL, Phase.DECODE),
        Mode.CONDITIONAL: (Phase.PREFILL, Phase.DECODE, Phase.COLOCATED),
    }[mode]
    return sum(any(ineligibility(v, ph, None) is None for ph in phases) for v in views)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """pdserve.v1.Scheduler on top of one ClusterScheduler."""

    def __init__(
        self, scheduler: ClusterScheduler, metrics: SchedulerMetrics | None = None
    ) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self._conflicts_exported = scheduler.conflicts

    @contextlib.contextmanager
    def _redis_errors(self, operation: str) -> Iterator[None]:
        """Count a call that fails on Redis under ``operation``, then let the error go on."""
        try:
            yield
        except Exception as err:
            if self.metrics is not None and _redis_failure(err):
                self.metrics.count_redis_error(operation)
            raise

    def _export_conflicts(self) -> None:
        """Bring the conflicts counter up to the scheduler's own (one event loop: no race)."""
        new = self.scheduler.conflicts - self._conflicts_exported
        if new > 0 and self.metrics is not None:
            self.metrics.count_conflict(new)
        self._conflicts_exported += new

    async def Assign(  # noqa: N802 - gRPC method names
        self, request: scheduler_pb2.AssignRequest, context: Context
    ) -> scheduler_pb2.Assignment:
        policy = self.scheduler.policy.name
        # The stage starts where the router's part ended: the call's travel and its wait for
        # this event loop belong to the placement too (``handover``).
        start = handover.stage_start(time.time_ns())
        with (
            handover.within(handover.stage_parent()),  # a child of router.request
            tracing.stage_span(SCHEDULER_ASSIGN, {ATTR_POLICY: policy}, start) as span,
        ):
            outcome = "error"
            try:
                with self._redis_errors("assign"):
                    mode = mode_of(request.mode)
                    assignment = await self.scheduler.assign(
                        request.request_id,
                        request.prompt_tokens,
                        request.max_tokens,
                        mode=mode,
                        tenant=request.tenant,
                        exclude=list(request.exclude),
                        decode_only=request.decode_only,
                        prompt_token_ids=request.prompt_token_ids,
                    )
                outcome = "assigned"
                if self.metrics is not None and assignment.decision is not None:
                    self.metrics.count_mode(assignment.mode.value, assignment.decision.reason)
            except Exception as err:
                outcome = _outcome(err)
                raise
            finally:
                self._export_conflicts()
                if self.metrics is not None:
                    self.metrics.count_decision(policy, outcome)
            if span.is_recording():
                # The view assign() decided on; max_age_s=inf reads the cache, never Redis.
                views = await self.scheduler.snapshot(max_age_s=float("inf"))
                span.set_attributes(
                    {
                        ATTR_CANDIDATES: _candidates(views, assignment.mode),
                        ATTR_RETRIES: assignment.retries,
                        ATTR_PREFILL_WORKER: assignment.prefill.id,
                        ATTR_DECODE_WORKER: assignment.decode.id,
                        ATTR_MODE: assignment.mode.value,
                        ATTR_MODE_REASON: (
                            assignment.decision.reason.value if assignment.decision else ""
                        ),
                    }
                )
            handover.mark_stage_end(time.time_ns())
            return assignment_to_proto(assignment)

    async def Release(  # noqa: N802
        self, request: scheduler_pb2.ReleaseRequest, context: Context
    ) -> scheduler_pb2.ReleaseResponse:
        with self._redis_errors("release"):
            released = await self.scheduler.release(
                reservation_id_of(request.reservation_id), prefill_only=request.prefill_only
            )
        return scheduler_pb2.ReleaseResponse(released=released)

    async def Renew(  # noqa: N802
        self, request: scheduler_pb2.RenewRequest, context: Context
    ) -> scheduler_pb2.RenewResponse:
        with self._redis_errors("renew"):
            ttl_s = await self.scheduler.renew(reservation_id_of(request.reservation_id))
        return scheduler_pb2.RenewResponse(ttl_s=ttl_s)

    async def ListWorkers(  # noqa: N802
        self, request: scheduler_pb2.ListWorkersRequest, context: Context
    ) -> scheduler_pb2.ListWorkersResponse:
        role = role_filter(request.role)
        with self._redis_errors("list_workers"):
            views = await self.scheduler.snapshot()
        index = self.scheduler.prefix_index
        return scheduler_pb2.ListWorkersResponse(
            workers=[
                worker_status(v, index.size(v.id) if index is not None else 0)
                for v in views
                if role is None or v.info.role is role
            ]
        )
