"""The Scheduler service's conversions (``adapters.scheduler``): the request enums both
ways, refusals by field, and the answers carrying every field of the domain objects."""

from __future__ import annotations

import pytest

from pdserve.adapters import scheduler as convert
from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.capacity import Claim, WorkerView
from pdserve.scheduling.placement import ModeDecision, Reason
from pdserve.scheduling.scheduler import Assignment, Mode
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole
from pdserve.v1 import common_pb2


def info(wid: str, role: WorkerRole) -> WorkerInfo:
    return WorkerInfo(
        id=wid,
        role=role,
        address=f"{wid}:1",
        host="h",
        model_fingerprint="fp",
        kv_blocks_total=100,
        kv_blocks_free=40,
        block_size=16,
        max_batch_tokens=2048,
        queued_tokens=5,
        running_seqs=3,
        draining=True,
        ts=12.0,
        kv_bytes_per_token=4096,
        interactive_tokens=256,
    )


def test_modes_and_roles_round_trip() -> None:
    for mode in Mode:
        assert convert.mode_of(convert.MODE_TO_PROTO[mode]) is mode
    assert convert.mode_of(common_pb2.MODE_UNSPECIFIED) is None
    for role in WorkerRole:
        assert convert.role_filter(convert.ROLE_TO_PROTO[role]) is role
    assert convert.role_filter(common_pb2.WORKER_ROLE_UNSPECIFIED) is None


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: convert.mode_of(99), "mode"),
        (lambda: convert.role_filter(99), "role"),
        (lambda: convert.reservation_id_of(""), "reservation_id"),
    ],
)
def test_bad_requests_name_the_field(call: object, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        call()  # type: ignore[operator]
    assert caught.value.field == field


def test_assignment_carries_every_field() -> None:
    decision = ModeDecision(Mode.COLOCATED, next(iter(Reason)), 100, True, 64, 0.5, 0.75, 32, 0.125)
    a = Assignment(
        "res-1",
        info("p", WorkerRole.PREFILL),
        info("d", WorkerRole.DECODE),
        Mode.COLOCATED,
        2,
        "least-loaded",
        30.0,
        decision,
    )
    msg = convert.assignment_to_proto(a)
    assert (msg.reservation_id, msg.retries, msg.policy, msg.ttl_s) == (
        "res-1",
        2,
        "least-loaded",
        30.0,
    )
    assert (msg.prefill.id, msg.prefill.address, msg.decode.id) == ("p", "p:1", "d")
    assert msg.mode == common_pb2.MODE_COLOCATED
    assert msg.decision.reason == decision.reason.value
    assert (msg.decision.long_prompt_tokens, msg.decision.cached_tokens) == (64, 32)
    assert (msg.decision.colocated_ttft_s, msg.decision.stall_s) == (0.5, 0.125)
    plain = convert.assignment_to_proto(
        Assignment("r", a.prefill, a.decode, Mode.DISAGGREGATED, 0, "p", 1.0)
    )
    assert not plain.HasField("decision")


def test_worker_status_carries_the_view() -> None:
    view = WorkerView(info("m", WorkerRole.MIXED), Claim(tokens=7, blocks=2), 0.5)
    msg = convert.worker_status(view, indexed_blocks=9)
    assert msg.role == common_pb2.WORKER_ROLE_MIXED
    assert (msg.id, msg.address, msg.kv_blocks_free, msg.running_seqs) == ("m", "m:1", 40, 3)
    assert (msg.reserved_tokens, msg.reserved_blocks, msg.heartbeat_age_s) == (7, 2, 0.5)
    assert msg.draining and msg.indexed_blocks == 9
    assert (msg.kv_bytes_per_token, msg.interactive_tokens) == (4096, 256)
