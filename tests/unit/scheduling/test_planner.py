"""The P:D planner's decisions on fake worker views."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.capacity import CapacityLimits, WorkerView
from pdserve.scheduling.costmodel import CostModel
from pdserve.scheduling.planner import (
    Bounds,
    PlannerConfig,
    Profile,
    Shed,
    decide,
    moves_for,
    pressure,
    slots_taken,
)
from pdserve.scheduling.worker_info import WorkerRole

from .factories import view

MODEL = CostModel()
CONFIG = PlannerConfig(ttft_slo_s=3.0, itl_slo_s=0.150, high=0.6, low=0.3)
CAN = ("prefill", "decode", "colocated")
MEASURED: dict[str, Any] = {
    "step_overhead_s": 0.010,
    "decode_seq_s": 0.001,
    "prefill_token_s": 0.0005,
    "max_batch_tokens": 2048,
    "capabilities": CAN,
}


def on_prefill(worker_id: str, **kw: Any) -> WorkerView:
    return view(worker_id, WorkerRole.MIXED, serves=("prefill",), duty="prefill",
                **{**MEASURED, **kw})  # fmt: skip


def on_decode(worker_id: str, **kw: Any) -> WorkerView:
    return view(worker_id, WorkerRole.MIXED, serves=("decode", "colocated"), duty="decode",
                **{**MEASURED, **kw})  # fmt: skip


def test_a_prefill_backlog_takes_the_least_busy_decode_worker() -> None:
    views = [
        on_prefill("p", queued_tokens=6000),  # 3 s of queue: pressure 1
        on_decode("d1", running_seqs=4),
        on_decode("d2", running_seqs=1),
    ]
    pr = pressure(views, MODEL, CONFIG)
    assert pr.prefill > CONFIG.high and pr.decode < CONFIG.low
    (move,) = decide(views, MODEL, CONFIG, hour=12)
    assert (move.worker_id, move.duty) == ("d2", "prefill")
    assert move.reason == "prefill pressure"


def test_decode_pressure_takes_an_idle_prefill_worker() -> None:
    views = [
        on_prefill("p1", queued_tokens=100),
        on_prefill("p2"),
        on_decode("d", running_seqs=150, kv_blocks_free=10),  # 160 ms steps, KV 90% used
    ]
    (move,) = decide(views, MODEL, CONFIG, hour=12)
    assert (move.worker_id, move.duty) == ("p2", "decode")


def test_colocated_prefills_queued_on_a_decode_worker_count_as_decode_pressure() -> None:
    calm = on_decode("d", running_seqs=4)  # 14 ms steps
    stalled = on_decode("d", running_seqs=4, queued_tokens=300)  # + 150 ms of prefill a step
    assert pressure([on_prefill("p"), calm], MODEL, CONFIG).decode < CONFIG.low
    assert pressure([on_prefill("p"), stalled], MODEL, CONFIG).decode > 1
    (move,) = decide([on_prefill("p1"), on_prefill("p2"), stalled], MODEL, CONFIG, hour=12)
    assert move.duty == "decode" and move.reason == "decode pressure"


def test_a_side_at_most_half_as_loaded_gives_a_worker() -> None:
    # Decode steps of 60 ms (0.4 of the ITL SLO) are not idle, but the prefill queue is at
    # twice that pressure.
    views = [
        on_prefill("p", queued_tokens=7000),  # about 3.5 s of queue: pressure ~1.2
        on_decode("d1", running_seqs=50),  # 10 + 50 ms steps: pressure 0.4
        on_decode("d2", running_seqs=50),
    ]
    pr = pressure(views, MODEL, CONFIG)
    assert pr.decode > CONFIG.low and pr.prefill >= 2 * pr.decode
    (move,) = decide(views, MODEL, CONFIG, hour=12)
    assert move.duty == "prefill"


def test_no_move_when_both_sides_are_busy_or_both_idle() -> None:
    both = [on_prefill("p", queued_tokens=6000), on_decode("d", running_seqs=150)]
    assert decide(both, MODEL, CONFIG, hour=12) == ()
    idle = [on_prefill("p"), on_decode("d1"), on_decode("d2")]
    assert decide(idle, MODEL, CONFIG, hour=12) == ()


def test_bounds_hold_and_a_switch_in_progress_blocks_moves() -> None:
    views = [on_prefill("p", queued_tokens=6000), on_decode("d", running_seqs=1)]
    assert decide(views, MODEL, CONFIG, hour=12) == ()  # min_decode = 1
    switching = [on_prefill("p", queued_tokens=6000), on_decode("d1"),
                 view("d2", WorkerRole.MIXED, serves=(), duty="decode", switching=True,
                      **MEASURED)]  # fmt: skip
    assert decide(switching, MODEL, CONFIG, hour=12) == ()


def test_profiles_set_the_bounds_by_hour() -> None:
    config = PlannerConfig(profiles=(Profile.parse("20-6:prefill=2..2,decode=1..1"),))
    views = [on_prefill("p"), on_decode("d1"), on_decode("d2")]
    (night,) = decide(views, MODEL, config, hour=23)
    assert night.duty == "prefill" and night.reason == "bounds"
    assert decide(views, MODEL, config, hour=12) == ()


def test_only_switchable_workers_move() -> None:
    fixed_decode = view("d", WorkerRole.DECODE, running_seqs=1, **{**MEASURED, "capabilities": ()})
    views = [view("p", WorkerRole.PREFILL, queued_tokens=6000, **MEASURED), fixed_decode]
    assert decide(views, MODEL, CONFIG, hour=12) == ()


@pytest.mark.parametrize("spec", ["8-20", "x-y:prefill=1..2", "8-20:prefill=2..1"])
def test_bad_profiles_are_refused(spec: str) -> None:
    with pytest.raises(InvalidArgumentError):
        Profile.parse(spec)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        PlannerConfig(high=0.2, low=0.5)
    with pytest.raises(InvalidArgumentError):
        Bounds(min_decode=3, max_decode=2)


def test_streams_waiting_for_a_batch_slot_are_decode_pressure() -> None:
    # Accelerator-like steps: 10 ms whatever the batch, far under the ITL SLO; but every one
    # of the 16 slots is taken and 8 more streams wait for one.
    fast = {"decode_seq_s": 0.0001, "max_seqs": 16}
    full = on_decode("d", running_seqs=16, waiting_decodes=8, **fast)
    calm = on_decode("d", running_seqs=4, **fast)
    assert slots_taken([full]) == pytest.approx(1.5)
    assert pressure([on_prefill("p"), full], MODEL, CONFIG).decode == pytest.approx(1.5)
    assert pressure([on_prefill("p"), calm], MODEL, CONFIG).decode < CONFIG.low
    # Workers that publish no slot count leave the term out rather than divide by zero.
    assert slots_taken([on_decode("d", running_seqs=16)]) == 0.0


def test_a_shifted_mix_moves_several_workers_at_once() -> None:
    # Six idle prefill workers, two decode workers with every slot taken twice over: one
    # drain for the whole shift, not one per worker; one prefill worker stays (min_prefill).
    fast = {"decode_seq_s": 0.0001, "max_seqs": 16}
    views = [on_prefill(f"p{i}") for i in range(6)] + [
        on_decode(f"d{i}", running_seqs=16, waiting_decodes=16, **fast) for i in range(2)
    ]
    moves = decide(views, MODEL, CONFIG, hour=12)
    assert len(moves) == 5 and len({m.worker_id for m in moves}) == 5
    assert all(m.duty == "decode" and m.reason == "decode pressure" for m in moves)
    assert {m.worker_id for m in moves} < {f"p{i}" for i in range(6)}


def test_the_giving_side_keeps_enough_workers_for_its_own_load() -> None:
    # The decode side asks for many, but the prefill side (pressure 0.25 over 4 workers)
    # can spare only two before its own pressure, spread over fewer, reaches high.
    assert moves_for(3.0, 2, 0.25, 4, room=3, config=CONFIG) == 2
    assert moves_for(3.0, 2, 0.0, 4, room=3, config=CONFIG) == 3  # room caps it
    assert moves_for(0.7, 4, 0.0, 4, room=3, config=CONFIG) == 3  # 4 x 0.7 / 0.45 -> 7
    assert moves_for(0.61, 1, 0.29, 1, room=1, config=CONFIG) == 1  # one is always allowed
    assert moves_for(3.0, 2, 0.0, 4, room=0, config=CONFIG) == 0


def test_a_prefill_side_that_sheds_load_is_under_pressure() -> None:
    # Fast prefill (1 ms of queue per 1,000 tokens) keeps the predicted wait far under the
    # TTFT SLO, but every prefill queue is at the scheduler's admission limit (4 batches of
    # 2,048 tokens): new prompts are refused, so the side asks for a worker.
    fast = {"prefill_token_s": 0.000001, "step_overhead_s": 0.0001}
    full = [on_prefill(f"p{i}", queued_tokens=8192, **fast) for i in range(2)]
    decodes = [on_decode(f"d{i}", running_seqs=1, **fast) for i in range(4)]
    pr = pressure(full + decodes, MODEL, CONFIG)
    assert pr.prefill == pytest.approx(1.0)
    moves = decide(full + decodes, MODEL, CONFIG, hour=12)
    assert moves and all(m.duty == "prefill" for m in moves)
    # A larger limit (the scheduler's --prefill-queue-batches) makes the same queues half full.
    roomy = PlannerConfig(limits=CapacityLimits(prefill_queue_batches=8.0))
    assert pressure(full + decodes, MODEL, roomy).prefill == pytest.approx(0.5)


def test_refusals_count_per_side_between_two_readings() -> None:
    before = {"prefill": 3, "decode": 1}
    after = {"prefill": 5, "decode": 1, "colocated": 2}
    assert Shed.between(before, after) == Shed(prefill=2, decode=2)
    # A counter that went back (Redis restarted and lost it) counts as no refusal.
    assert Shed.between(after, {}) == Shed()


def test_a_side_that_shed_load_takes_all_the_other_side_can_spare() -> None:
    # Queues that look calm (refused prompts never reach a queue), but the schedulers
    # refused prefill work since the last pass: saturated, so every decode worker the decode
    # side can spare moves (min_decode keeps one), not one by one.
    views = [on_prefill("p", queued_tokens=10)] + [on_decode(f"d{i}") for i in range(4)]
    assert decide(views, MODEL, CONFIG, hour=12) == ()
    moves = decide(views, MODEL, CONFIG, hour=12, shed=Shed(prefill=1))
    assert len(moves) == 3 and all(m.duty == "prefill" for m in moves)
    # The decode side sheds instead: the idle prefill side gives what it can (none: one left).
    assert decide(views, MODEL, CONFIG, hour=12, shed=Shed(decode=1)) == ()
