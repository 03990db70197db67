"""Per-request stage durations and their percentiles, against independently computed values."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.telemetry.breakdown import compute_breakdown, percentile
from pdserve.telemetry.record import SpanRecord

from .synthetic import ROOT, STAGE_NAMES, make_traces


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_matches_numpys_linear_method(n: int) -> None:
    rng = random.Random(n)
    values = [rng.uniform(0, 50) for _ in range(n)]
    for q in (0, 1, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-9)


def test_percentile_rejects_empty_input_and_bad_q() -> None:
    with pytest.raises(InvalidArgumentError):
        percentile([], 50)
    with pytest.raises(InvalidArgumentError):
        percentile([1.0], 101)


def test_breakdown_of_synthetic_traces() -> None:
    synth = make_traces(30)
    spans = [SpanRecord.from_json(line) for line in synth.lines]
    bd = compute_breakdown(spans)
    assert [r.request_id for r in bd.requests] == synth.request_ids
    assert [r.e2e_ns for r in bd.requests] == synth.e2e_ns
    assert bd.skipped_traces == 1 and bd.missing_stages == ()
    stats = {s.stage: s for s in bd.stats}
    assert [s.stage for s in bd.stats] == [ROOT, *STAGE_NAMES]
    total_e2e = sum(synth.e2e_ns)
    for stage, durations in [(ROOT, synth.e2e_ns), *synth.stage_ns.items()]:
        ms = np.array(durations) / 1e6
        s = stats[stage]
        assert s.count == len(durations)
        assert s.p50_ms == pytest.approx(np.percentile(ms, 50), abs=1e-9)
        assert s.p90_ms == pytest.approx(np.percentile(ms, 90), abs=1e-9)
        assert s.p99_ms == pytest.approx(np.percentile(ms, 99), abs=1e-9)
        assert s.mean_ms == pytest.approx(ms.mean(), abs=1e-9)
        assert s.share == pytest.approx(sum(durations) / total_e2e)
    # Every third request is colocated: no KV transfer.
    assert stats["kv.transfer.send"].count == 20
    first = bd.requests[0]
    assert {i.stage for i in first.intervals} == set(STAGE_NAMES)
    assert all(
        i.offset_ns >= 0 and i.offset_ns + i.duration_ns <= first.e2e_ns for i in first.intervals
    )


def _span(trace: str, sid: str, parent: str | None, name: str, start: int, end: int) -> SpanRecord:
    return SpanRecord(trace, sid, parent, name, "svc", start, end, {"pdserve.request_id": sid})


def test_two_requests_in_one_trace_are_split_by_ancestry() -> None:
    t = "1" * 32
    spans = [
        _span(t, "a" * 16, None, ROOT, 0, 100),
        _span(t, "b" * 16, None, ROOT, 10, 60),
        _span(t, "c" * 16, "a" * 16, "rpc", 5, 50),
        _span(t, "d" * 16, "c" * 16, "prefill.compute", 6, 40),  # under a, via an rpc span
        _span(t, "e" * 16, "b" * 16, "prefill.compute", 20, 25),
        _span(t, "f" * 16, "b" * 16, "prefill.compute", 30, 33),  # a second one adds up
        _span(t, "0" * 15 + "1", "9" * 16, "decode.queue", 1, 2),  # parent unknown: dropped
    ]
    bd = compute_breakdown(spans)
    by_id = {r.request_id: r for r in bd.requests}
    assert by_id["a" * 16].stage_ns == {"prefill.compute": 34}
    assert by_id["b" * 16].stage_ns == {"prefill.compute": 8}
    assert "decode.queue" in bd.missing_stages


def test_no_requests_gives_empty_stats() -> None:
    bd = compute_breakdown([_span("2" * 32, "a" * 16, None, "prefill.compute", 0, 5)])
    assert bd.requests == () and bd.stats == () and bd.skipped_traces == 1
    assert bd.missing_stages == STAGE_NAMES


def test_release_traces_are_neither_requests_nor_skipped() -> None:
    release = [
        _span("3" * 32, "a" * 16, None, "router.release", 0, 5),
        _span("3" * 32, "b" * 16, "a" * 16, "/pdserve.v1.Scheduler/Release", 1, 4),
    ]
    other = [_span("4" * 32, "c" * 16, None, "/pdserve.v1.Scheduler/Assign", 0, 5)]
    bd = compute_breakdown([*release, *other])
    assert bd.requests == () and bd.skipped_traces == 1  # only the trace without a request
