"""StepMeter fits the step-time model from the steps it is shown; Duty drains before a switch."""

from __future__ import annotations

import math

import pytest

from pdserve.engine.step_meter import StepMeter
from pdserve.scheduling.worker_info import WorkerRole
from pdserve.worker.duty import Duty, capabilities


def run_steps(meter: StepMeter, steps: list[tuple[int, int]], *, gap_s: float = 0.0) -> float:
    """Feed steps of (prompt tokens, decodes) timed by t = 5 ms + 1 ms/seq + 0.2 ms/token."""
    t = 100.0
    for tokens, decodes in steps:
        seconds = 0.005 + 0.001 * decodes + 0.0002 * tokens
        meter.observe(tokens, decodes, t, t + seconds)
        t += seconds + gap_s
    return t


def test_the_fit_recovers_the_step_model() -> None:
    meter = StepMeter(busy_window_s=0.1)
    steps = [(0, n) for n in (1, 4, 8, 2, 16, 6) * 5] + [(p, 3) for p in (300, 2000, 400) * 3]
    run_steps(meter, steps)
    m = meter.reading()
    assert m.overhead_s == pytest.approx(0.005, rel=1e-6)
    assert m.decode_seq_s == pytest.approx(0.001, rel=1e-6)
    assert m.prefill_token_s == pytest.approx(0.0002, rel=1e-6)
    assert m.busy == pytest.approx(1.0, abs=0.05)  # back-to-back steps


def test_one_batch_size_only_counts_as_overhead() -> None:
    meter = StepMeter()
    run_steps(meter, [(0, 4)] * 10)
    m = meter.reading()
    assert m.decode_seq_s == 0.0 and m.overhead_s == pytest.approx(0.009)
    assert m.prefill_token_s == 0.0  # no prefill seen yet


def test_busy_falls_with_idle_gaps_and_while_idle() -> None:
    meter = StepMeter(busy_window_s=1.0)
    end = run_steps(meter, [(0, 4)] * 200, gap_s=0.027)  # steps of 9 ms every 36 ms
    m = meter.reading()
    assert m.busy == pytest.approx(0.25, abs=0.05)
    assert m.busy_at(end + 2.0) == pytest.approx(m.busy * math.exp(-2.0), rel=0.05)


def test_short_prefills_do_not_set_the_per_token_cost() -> None:
    meter = StepMeter(min_prefill_tokens=256)
    run_steps(meter, [(0, 2), (0, 6)] * 5 + [(64, 2)] * 10)
    assert meter.reading().prefill_token_s == 0.0
    run_steps(meter, [(1024, 2)])
    assert meter.reading().prefill_token_s == pytest.approx(0.0002)


def test_empty_or_zero_length_steps_are_ignored() -> None:
    meter = StepMeter()
    meter.observe(0, 0, 1.0, 2.0)
    meter.observe(10, 0, 1.0, 1.0)
    assert meter.reading().overhead_s == 0.0 and meter.reading().prefill_token_s == 0.0


def test_a_duty_change_drains_before_it_takes_effect() -> None:
    can = capabilities(WorkerRole.MIXED, can_prefill=True)
    assert can == ("prefill", "decode", "colocated")
    duty = Duty(WorkerRole.MIXED, can)
    assert duty.state(idle=False) == (can, "", False)
    duty.order(b"prefill")
    # Busy: serves what the old and new duty share (prefill) and says it is switching.
    assert duty.state(idle=False) == (("prefill",), "prefill", True)
    assert duty.state(idle=True) == (("prefill",), "prefill", False)
    duty.order(b"decode")
    assert duty.state(idle=False) == ((), "decode", True)  # nothing in common: takes nothing
    assert duty.state(idle=True) == (("decode", "colocated"), "decode", False)
    assert duty.switches == 2
    duty.order(None)  # the planner's key is gone: everything it can
    assert duty.state(idle=True) == (can, "", False)


def test_impossible_duties_are_ignored() -> None:
    decode_only = Duty(WorkerRole.MIXED, capabilities(WorkerRole.MIXED, can_prefill=False))
    decode_only.order(b"prefill")  # no KV store: it cannot hand a prefill's KV over
    assert decode_only.state(idle=True) == (("decode", "colocated"), "", False)
    not_mixed = Duty(WorkerRole.DECODE, capabilities(WorkerRole.DECODE, can_prefill=False))
    not_mixed.order(b"prefill")
    assert not_mixed.state(idle=True) == (("decode",), "", False)
    bogus = Duty(WorkerRole.MIXED, capabilities(WorkerRole.MIXED, can_prefill=True))
    bogus.order(b"cook")
    assert bogus.target == ""
