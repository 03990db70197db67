"""The Scheduler service: its requests' enums and ids to the scheduling layer's types, and
``Assignment`` / ``WorkerView`` to its answers (``Assignment``, ``WorkerStatus``)."""

from __future__ import annotations

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.capacity import WorkerView
from pdserve.scheduling.placement import ModeDecision
from pdserve.scheduling.scheduler import Assignment, Mode
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole
from pdserve.v1 import common_pb2, scheduler_pb2

MODE_FROM_PROTO: dict[int, Mode | None] = {
    common_pb2.MODE_UNSPECIFIED: None,  # the scheduler's default mode
    common_pb2.MODE_DISAGGREGATED: Mode.DISAGGREGATED,
    common_pb2.MODE_COLOCATED: Mode.COLOCATED,
    common_pb2.MODE_CONDITIONAL: Mode.CONDITIONAL,
}
MODE_TO_PROTO: dict[Mode, common_pb2.Mode] = {
    Mode.DISAGGREGATED: common_pb2.MODE_DISAGGREGATED,
    Mode.COLOCATED: common_pb2.MODE_COLOCATED,
    Mode.CONDITIONAL: common_pb2.MODE_CONDITIONAL,
}
ROLE_TO_PROTO: dict[WorkerRole, common_pb2.WorkerRole] = {
    WorkerRole.PREFILL: common_pb2.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: common_pb2.WORKER_ROLE_DECODE,
    WorkerRole.MIXED: common_pb2.WORKER_ROLE_MIXED,
}
ROLE_FROM_PROTO: dict[int, WorkerRole] = {v: k for k, v in ROLE_TO_PROTO.items()}


def mode_of(value: int) -> Mode | None:
    """The mode an ``AssignRequest`` asks for; None: the scheduler's default."""
    if value not in MODE_FROM_PROTO:
        raise InvalidArgumentError("mode", f"unknown mode {value}")
    return MODE_FROM_PROTO[value]


def role_filter(value: int) -> WorkerRole | None:
    """The role a ``ListWorkersRequest`` keeps; None (unspecified): every role."""
    if value == common_pb2.WORKER_ROLE_UNSPECIFIED:
        return None
    if value not in ROLE_FROM_PROTO:
        raise InvalidArgumentError("role", f"unknown role {value}")
    return ROLE_FROM_PROTO[value]


def reservation_id_of(value: str) -> str:
    """A ``Release`` or ``Renew`` request's reservation id, which must be set."""
    if not value:
        raise InvalidArgumentError("reservation_id", "must be set")
    return value


def worker_ref(info: WorkerInfo) -> scheduler_pb2.WorkerRef:
    return scheduler_pb2.WorkerRef(id=info.id, address=info.address, host=info.host)


def mode_decision_to_proto(d: ModeDecision | None) -> scheduler_pb2.ModeDecision | None:
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


def assignment_to_proto(a: Assignment) -> scheduler_pb2.Assignment:
    return scheduler_pb2.Assignment(
        reservation_id=a.reservation_id,
        prefill=worker_ref(a.prefill),
        decode=worker_ref(a.decode),
        retries=a.retries,
        policy=a.policy,
        mode=MODE_TO_PROTO[a.mode],
        ttl_s=a.ttl_s,
        decision=mode_decision_to_proto(a.decision),
    )


def worker_status(view: WorkerView, indexed_blocks: int = 0) -> scheduler_pb2.WorkerStatus:
    """One worker as ``ListWorkers`` reports it; ``indexed_blocks``: its prompt blocks in the
    scheduler's prefix index."""
    info = view.info
    return scheduler_pb2.WorkerStatus(
        id=info.id,
        role=ROLE_TO_PROTO[info.role],
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
        kv_bytes_per_token=info.kv_bytes_per_token,
        interactive_tokens=info.interactive_tokens,
    )
