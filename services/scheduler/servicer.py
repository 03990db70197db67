"""The Scheduler gRPC service: translates pdserve.v1 messages to ClusterScheduler calls."""

from __future__ import annotations

from typing import Any, TypeAlias

from grpc.aio import ServicerContext

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling import (
    Assignment,
    ClusterScheduler,
    Mode,
    WorkerInfo,
    WorkerRole,
    WorkerView,
)
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

_MODE_FROM_PROTO = {
    common_pb2.MODE_UNSPECIFIED: None,  # the scheduler's default mode
    common_pb2.MODE_DISAGGREGATED: Mode.DISAGGREGATED,
    common_pb2.MODE_COLOCATED: Mode.COLOCATED,
}
_MODE_TO_PROTO = {
    Mode.DISAGGREGATED: common_pb2.MODE_DISAGGREGATED,
    Mode.COLOCATED: common_pb2.MODE_COLOCATED,
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


def _assignment(a: Assignment) -> scheduler_pb2.Assignment:
    return scheduler_pb2.Assignment(
        reservation_id=a.reservation_id,
        prefill=_worker_ref(a.prefill),
        decode=_worker_ref(a.decode),
        retries=a.retries,
        policy=a.policy,
        mode=_MODE_TO_PROTO[a.mode],
        ttl_s=a.ttl_s,
    )


def _worker_status(view: WorkerView) -> scheduler_pb2.WorkerStatus:
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
    )


def _reservation_id(value: str) -> str:
    if not value:
        raise InvalidArgumentError("reservation_id", "must be set")
    return value


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """pdserve.v1.Scheduler on top of one ClusterScheduler."""

    def __init__(self, scheduler: ClusterScheduler) -> None:
        self.scheduler = scheduler

    async def Assign(  # noqa: N802 - gRPC method names
        self, request: scheduler_pb2.AssignRequest, context: Context
    ) -> scheduler_pb2.Assignment:
        if request.mode not in _MODE_FROM_PROTO:
            raise InvalidArgumentError("mode", f"unknown mode {request.mode}")
        assignment = await self.scheduler.assign(
            request.request_id,
            request.prompt_tokens,
            request.max_tokens,
            mode=_MODE_FROM_PROTO[request.mode],
            tenant=request.tenant,
        )
        return _assignment(assignment)

    async def Release(  # noqa: N802
        self, request: scheduler_pb2.ReleaseRequest, context: Context
    ) -> scheduler_pb2.ReleaseResponse:
        released = await self.scheduler.release(
            _reservation_id(request.reservation_id), prefill_only=request.prefill_only
        )
        return scheduler_pb2.ReleaseResponse(released=released)

    async def Renew(  # noqa: N802
        self, request: scheduler_pb2.RenewRequest, context: Context
    ) -> scheduler_pb2.RenewResponse:
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
        views = await self.scheduler.snapshot()
        return scheduler_pb2.ListWorkersResponse(
            workers=[_worker_status(v) for v in views if role is None or v.info.role is role]
        )
