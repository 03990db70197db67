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

from pdserve.errors import CapacityError, InvalidArgumentError, WorkerUnavailableError
from pdserve.scheduling import (
    Assignment,
    ClusterScheduler,
    Mode,
    WorkerInfo,
    WorkerRole,
    WorkerView,
)
from pdserve.scheduling.capacity import Phase, ineligibility
from pdserve.scheduling.placement import ModeDecision
from pdserve.scheduling.quotas import QuotaExceededError
from pdserve.scheduling.scheduler import SloRefusalError
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
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

_MODE_FROM_PROTO = {
    common_pb2.MODE_UNSPECIFIED: None,  # the scheduler's default mode
    common_pb2.MODE_DISAGGREGATED: Mode.DISAGGREGATED,
    common_pb2.MODE_COLOCATED: Mode.COLOCATED,
    common_pb2.MODE_CONDITIONAL: Mode.CONDITIONAL,
}
_MODE_TO_PROTO = {
    Mode.DISAGGREGATED: common_pb2.MODE_DISAGGREGATED,
    Mode.COLOCATED: common_pb2.MODE_COLOCATED,
    Mode.CONDITIONAL: common_pb2.MODE_CONDITIONAL,
}
_ROLE_TO_PROTO = {
    WorkerRole.PREFILL: common_pb2.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: common_pb2.WORKER_ROLE_DECODE,
    WorkerRole.MIXED: common_pb2.WORKER_ROLE_MIXED,
}
_ROLE_FROM_PROTO = {v: k for k, v in _ROLE_TO_PROTO.items()}

Context: TypeAlias = ServicerContext[Any, Any]


def _worker_ref(info: WorkerInfo) -> scheduler_pb2.WorkerRef:
    return scheduler_pb2.WorkerRef(id=info.id, address=info.address, host=info.host)


def _decision(d: ModeDecision | None) -> scheduler_pb2.ModeDecision | None:
    if d is None:
        return None
    return scheduler_pb2.ModeDecision(
        reason=d.reason.value,
        long_prompt=d.long_prompt,
        long_prompt_tokens=d.long_prompt_tokens,
        colocated_ttft_s=d.colocated_ttft_s,
        disaggregated_ttft_s=d.disaggregated_ttft_s,
        cached_tokens=d.cached_tokens,
        stall_s=d.stall_s,
    )


def _assignment(a: Assignment) -> scheduler_pb2.Assignment:
    return scheduler_pb2.Assignment(
        reservation_id=a.reservation_id,
        prefill=_worker_ref(a.prefill),
        decode=_worker_ref(a.decode),
        retries=a.retries,
        policy=a.policy,
        mode=_MODE_TO_PROTO[a.mode],
        ttl_s=a.ttl_s,
        decision=_decision(a.decision),
    )


def _worker_status(view: WorkerView, indexed_blocks: int = 0) -> scheduler_pb2.WorkerStatus:
    info = view.info
    return scheduler_pb2.WorkerStatus(
        id=info.id,
        role=_ROLE_TO_PROTO[info.role],
        address=info.address,
        host=info.host,
        model_fingerprint=info.model_fingerprint,
        kv_blocks_total=info.kv_blocks_total,
        kv_blocks_free=info.kv_blocks_free,
        block_size=info.block_size,
        max_batch_tokens=info.max_batch_tokens,
        queued_tokens=info.queued_tokens,
        running_seqs=info.running_seqs,
        draining=info.draining,
        ts=info.ts,
        heartbeat_age_s=view.heartbeat_age_s,
        reserved_tokens=view.reserved.tokens,
        reserved_blocks=view.reserved.blocks,
        serves=list(info.phases),
        lane=info.lane,
        duty=info.duty,
        switching=info.switching,
        step_overhead_s=info.step_overhead_s,
        decode_seq_s=info.decode_seq_s,
        prefill_token_s=info.prefill_token_s,
        busy=info.busy,
        indexed_blocks=indexed_blocks,
    )


def _reservation_id(value: str) -> str:
    if not value:
        raise InvalidArgumentError("reservation_id", "must be set")
    return value


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
                    if request.mode not in _MODE_FROM_PROTO:
                        raise InvalidArgumentError("mode", f"unknown mode {request.mode}")
                    mode = _MODE_FROM_PROTO[request.mode]
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
            return _assignment(assignment)

    async def Release(  # noqa: N802
        self, request: scheduler_pb2.ReleaseRequest, context: Context
    ) -> scheduler_pb2.ReleaseResponse:
        with self._redis_errors("release"):
            released = await self.scheduler.release(
                _reservation_id(request.reservation_id), prefill_only=request.prefill_only
            )
        return scheduler_pb2.ReleaseResponse(released=released)

    async def Renew(  # noqa: N802
        self, request: scheduler_pb2.RenewRequest, context: Context
    ) -> scheduler_pb2.RenewResponse:
        with self._redis_errors("renew"):
            ttl_s = await self.scheduler.renew(_reservation_id(request.reservation_id))
        return scheduler_pb2.RenewResponse(ttl_s=ttl_s)

    async def ListWorkers(  # noqa: N802
        self, request: scheduler_pb2.ListWorkersRequest, context: Context
    ) -> scheduler_pb2.ListWorkersResponse:
        if (
            request.role != common_pb2.WORKER_ROLE_UNSPECIFIED
            and request.role not in _ROLE_FROM_PROTO
        ):
            raise InvalidArgumentError("role", f"unknown role {request.role}")
        role = _ROLE_FROM_PROTO.get(request.role)
        with self._redis_errors("list_workers"):
            views = await self.scheduler.snapshot()
        index = self.scheduler.prefix_index
        return scheduler_pb2.ListWorkersResponse(
            workers=[
                _worker_status(v, index.size(v.id) if index is not None else 0)
                for v in views
                if role is None or v.info.role is role
            ]
        )
