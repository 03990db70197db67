"""``pdserve.timing``: every figure of a ``Timing`` derived from the raw stamps, and the
router's merge of the workers' figures."""

from __future__ import annotations

import pytest

from pdserve.timing import RECOMPUTE, RequestTiming, Timing


def stamps() -> RequestTiming:
    # perf_counter seconds: 2 ms queued, 5 ms to the first output, 30 ms more to the last.
    t = RequestTiming(submitted=100.000)
    t.first_step_start, t.first_output, t.last_output = 100.002, 100.007, 100.037
    return t


def test_a_prefill_is_its_queue_and_its_first_output() -> None:
    t = stamps().prefill(transfer_ms=1.5, transfer_bytes=4096, transport="shm")
    assert t.queue_ms == pytest.approx(2.0)
    assert t.prefill_ms == pytest.approx(5.0)
    assert (t.transfer_ms, t.transfer_bytes, t.transport) == (1.5, 4096, "shm")
    assert (t.decode_ms, t.ttft_ms, t.e2e_ms) == (0.0, 0.0, 0.0)


def test_a_decode_counts_every_step_and_the_arrival() -> None:
    raw = stamps()
    t = raw.decode(
        started=raw.submitted - 0.010,  # the call arrived 10 ms before the engine call
        recompute_ms=0.0, transfer_ms=7.0, transfer_bytes=10, transport="store",
    )  # fmt: skip
    assert t.decode_ms == pytest.approx(35.0)  # first step to last output
    assert t.e2e_ms > 10.0  # from the call's arrival to now
    assert (t.transfer_ms, t.transfer_bytes, t.transport) == (7.0, 10, "store")


def test_a_colocated_run_splits_prefill_and_decode() -> None:
    t = stamps().generate()
    assert t.prefill_ms == pytest.approx(5.0)
    assert t.decode_ms == pytest.approx(30.0)
    assert t.ttft_ms == pytest.approx(7.0)
    assert t.e2e_ms == pytest.approx(37.0)
    migrated = stamps().generate(started=0.0, transport=RECOMPUTE)
    assert migrated.ttft_ms == 0.0 and migrated.transport == RECOMPUTE


def test_a_request_that_never_ran_has_zero_figures() -> None:
    assert RequestTiming().prefill() == Timing()


def test_the_decode_side_adds_to_the_prefill_side() -> None:
    prefill = Timing(queue_ms=1.0, prefill_ms=5.0, transfer_ms=2.0, transfer_bytes=100,
                     transport="store")  # fmt: skip
    moved = prefill.after_decode(Timing(queue_ms=0.5, transfer_ms=3.0, decode_ms=9.0,
                                        transfer_bytes=100, transport="store"))  # fmt: skip
    assert (moved.queue_ms, moved.prefill_ms, moved.transfer_ms) == (1.5, 5.0, 5.0)
    assert (moved.decode_ms, moved.transfer_bytes, moved.transport) == (9.0, 100, "store")
    # The receive failed and the decode worker prefilled: no KV reached it.
    recomputed = prefill.after_decode(Timing(prefill_ms=4.0, transfer_ms=1.0, decode_ms=9.0,
                                             transport=RECOMPUTE))  # fmt: skip
    assert recomputed.prefill_ms == 9.0 and recomputed.transfer_bytes == 0
    assert recomputed.transport == RECOMPUTE


def test_a_colocated_workers_figures_replace_the_stages() -> None:
    router = Timing(queue_ms=2.0)
    merged = router.after_generate(Timing(queue_ms=1.0, prefill_ms=5.0, decode_ms=30.0,
                                          ttft_ms=99.0))  # fmt: skip
    assert (merged.queue_ms, merged.prefill_ms, merged.decode_ms) == (3.0, 5.0, 30.0)
    assert merged.ttft_ms == 0.0  # the router measures its own
