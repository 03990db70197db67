"""A worker's heartbeat from its identity, its engine's load and its duty."""

from __future__ import annotations

import pytest

from pdserve.backends import Capacity
from pdserve.engine.step_meter import StepModel
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.worker.duty import Duty, capabilities
from pdserve.worker.heartbeat import WorkerIdentity, worker_info

IDENTITY = WorkerIdentity("m0", WorkerRole.MIXED, "127.0.0.1:1", "host", "fp", 2048,
                          lane="short", kv_bytes_per_token=8192,
                          interactive_tokens=256, transports=("direct", "recompute"))  # fmt: skip


def snapshot(*, running: int, waiting: int = 0) -> Capacity:
    steps = StepModel(0.01, 0.001, 0.0003, busy=0.5, as_of=100.0, busy_window_s=5.0)
    return Capacity(
        blocks_total=100, blocks_free=90, block_size=16, queued_tokens=0, running=running,
        waiting=waiting, tags=("r1",), steps=steps,
    )  # fmt: skip


def test_the_heartbeat_carries_the_step_model_lane_and_links() -> None:
    info = worker_info(
        IDENTITY, snapshot(running=2), draining=False,
        links=(("peer", "shm", 3e9),), now=105.0,
    )  # fmt: skip
    assert (info.step_overhead_s, info.decode_seq_s, info.prefill_token_s) == (0.01, 0.001, 0.0003)
    assert info.busy == pytest.approx(0.5 * 0.3678794, rel=1e-5)  # 5 s idle: one time constant
    assert info.lane == "short" and info.kv_bytes_per_token == 8192
    assert info.interactive_tokens == 256 and info.transports == ("direct", "recompute")
    assert info.links == (("peer", "shm", 3e9),) and info.reservations == ("r1",)
    assert info.serves == () and info.phases == ("decode", "colocated")  # no duty: by role
    assert (info.kv_bytes_per_s, info.kv_peak_bytes_per_s) == (None, None)  # no meter


def test_the_heartbeat_carries_the_live_kv_bandwidth() -> None:
    info = worker_info(IDENTITY, snapshot(running=0), draining=False, bandwidth=(5e6, 5e8))
    assert (info.kv_bytes_per_s, info.kv_peak_bytes_per_s) == (5e6, 5e8)


def test_the_heartbeat_reports_a_duty_switch_until_the_engine_is_idle() -> None:
    duty = Duty(WorkerRole.MIXED, capabilities(WorkerRole.MIXED, can_prefill=True))
    duty.order(b"prefill")
    busy = worker_info(IDENTITY, snapshot(running=3), draining=False, duty=duty, now=100.0)
    assert busy.switching and busy.duty == "prefill" and busy.phases == ("prefill",)
    assert busy.capabilities == ("prefill", "decode", "colocated")
    idle = worker_info(IDENTITY, snapshot(running=0), draining=False, duty=duty, now=100.0)
    assert not idle.switching and idle.phases == ("prefill",)


def test_leaving_decode_duty_hands_the_streams_back_once() -> None:
    """With ``hand_back`` (``--duty-switch migrate``) an order that takes decode away hands
    the running streams back at once, so the switch need not wait for them; an order that
    keeps decode, or one repeated, hands nothing back."""
    why: list[str] = []
    can = capabilities(WorkerRole.MIXED, can_prefill=True)
    duty = Duty(WorkerRole.MIXED, can, "decode", hand_back=why.append)
    duty.order(b"")  # everything it can: it still decodes
    assert why == []
    duty.order(b"prefill")
    duty.order(b"prefill")  # read again with the next heartbeat
    assert len(why) == 1 and "'prefill'" in why[0]
    duty.order(b"decode")  # back towards decode: nothing to hand back
    assert len(why) == 1
    draining = Duty(WorkerRole.MIXED, can, "decode")  # no hand_back: its streams drain
    draining.order(b"prefill")
    busy = worker_info(IDENTITY, snapshot(running=3), draining=False, duty=draining, now=1.0)
    assert busy.switching


def test_a_start_duty_holds_while_no_order_is_in_redis() -> None:
    duty = Duty(WorkerRole.MIXED, capabilities(WorkerRole.MIXED, can_prefill=True), "decode")
    duty.order(None)  # the heartbeat read no key: no planner has ordered anything
    info = worker_info(IDENTITY, snapshot(running=0), draining=False, duty=duty, now=100.0)
    assert info.duty == "decode" and info.phases == ("decode", "colocated")
    duty.order(b"")  # an explicit order for everything it can
    info = worker_info(IDENTITY, snapshot(running=0), draining=False, duty=duty, now=100.0)
    assert info.duty == "" and info.phases == ("prefill", "decode", "colocated")
    duty.order(b"prefill")
    duty.order(None)  # the order is gone (Redis restarted): back to the start duty
    info = worker_info(IDENTITY, snapshot(running=0), draining=False, duty=duty, now=100.0)
    assert info.duty == "decode" and duty.switches == 2
