"""`bench serve` rate sweep and search, through the real runner, against fakes of the Target
seam whose goodput is a known function of the rate."""

from __future__ import annotations

import asyncio
import math

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve_bench.serve.metrics import Slo
from pdserve_bench.serve.mixes import SHORT_ONLY
from pdserve_bench.serve.sweep import RateSearch, SearchSpec, run_all
from pdserve_bench.serve.workload import Load

from .fakes import FakeTarget

N = 20
LOAD = Load(vocab_size=1000, mix=SHORT_ONLY, num_requests=N, seed=7)
SLO = Slo()


def falling(rate: float | None) -> float:
    """Goodput 1 up to 200 req/s, then down by 0.25 per 100 req/s."""
    assert rate is not None
    return min(1.0, max(0.0, 1.0 - (rate - 200.0) / 400.0))


def measured(rate: float) -> float:
    """What a point of N requests measures against the fake: whole requests refused."""
    return 1.0 - math.floor(N * (1.0 - falling(rate)) + 1e-9) / N


def test_search_finds_the_highest_rate_that_keeps_the_goodput() -> None:
    target = FakeTarget("fake", falling)
    spec = SearchSpec(low=50.0, high=450.0, resolution=10.0, goal=0.9)
    result = asyncio.run(
        run_all([target], LOAD, rates=[], search=spec, slo=SLO, request_timeout_s=30.0)
    )
    # measured(r) >= 0.9 <=> floor(20 (r - 200) / 400) <= 2 <=> r < 260.
    threshold = 260.0
    search = result.searches["fake"]
    best = search.best
    assert best is not None and threshold - spec.resolution <= best < threshold
    doc = search.to_json()
    assert threshold <= doc["lowest_failing_rate"] <= best + spec.resolution
    for p in result.points:  # every probe measured what the known function says
        assert p.rate is not None and p.summary.goodput == pytest.approx(measured(p.rate))
        assert p.summary.sent == N and p.phase == "search"
    assert target.rates == [p.rate for p in result.points]
    assert target.rates[:2] == [50.0, 450.0]  # the bounds first, then bisection


def test_fixed_rates_narrow_the_search_and_targets_interleave() -> None:
    a, b = FakeTarget("a", falling), FakeTarget("b", lambda r: falling((r or 0) + 100.0))
    spec = SearchSpec(low=50.0, high=450.0, resolution=25.0, goal=0.9)
    result = asyncio.run(
        run_all([a, b], LOAD, rates=[100.0, 300.0], search=spec, slo=SLO, request_timeout_s=30.0)
    )
    order = [(p.target, p.rate, p.phase) for p in result.points]
    assert order[:4] == [("a", 100.0, "sweep"), ("b", 100.0, "sweep"),
                         ("a", 300.0, "sweep"), ("b", 300.0, "sweep")]  # fmt: skip
    # The sweep bracketed both answers (100 passes, 300 fails), so no bound is probed again.
    assert all(100.0 < r < 300.0 for r in a.rates[2:] + b.rates[2:])
    # While both search, their probes alternate: a, b, a, b, ...
    search_targets = [t for t, _r, phase in order if phase == "search"]
    both = 2 * min(search_targets.count("a"), search_targets.count("b"))
    assert search_targets[:both] == ["a", "b"] * (both // 2)
    best_a, best_b = result.searches["a"].best, result.searches["b"].best
    assert best_a is not None and 235.0 <= best_a < 260.0
    assert best_b is not None and 135.0 <= best_b < 160.0  # b is 100 req/s worse
    assert a.opened is False  # run_all leaves opening and closing to its caller


def test_a_target_that_goes_down_is_dropped_and_the_others_go_on() -> None:
    a, b = FakeTarget("a"), FakeTarget("b", points_before_down=1)
    result = asyncio.run(
        run_all([a, b], LOAD, rates=[100.0, 200.0, 300.0], search=None, slo=SLO,
                request_timeout_s=30.0)
    )  # fmt: skip
    assert [(p.target, p.rate) for p in result.points] == [
        ("a", 100.0), ("b", 100.0), ("a", 200.0), ("a", 300.0),
    ]  # fmt: skip
    assert "went away" in result.down["b"]


def test_search_edges() -> None:
    s = RateSearch(1.0, 16.0, 0.5, 0.9)
    assert s.next_rate() == 1.0
    s.record(1.0, 0.5)
    assert s.next_rate() is None and s.best is None  # even the low bound misses
    s = RateSearch(1.0, 16.0, 0.5, 0.9)
    s.record(1.0, 1.0)
    assert s.next_rate() == 16.0
    s.record(16.0, 0.95)
    assert s.next_rate() is None and s.best == 16.0 and s.to_json()["capped"]
    s = RateSearch(1.0, 16.0, 0.5, 0.9)
    for rate, goodput in ((2.0, 1.0), (4.0, 0.92), (6.0, 0.3), (8.0, 0.95)):
        s.record(rate, goodput)  # 8 passing above a failing 6 is noise: ignored
    assert s.next_rate() == 5.0
    s.record(5.0, 0.91)
    assert s.next_rate() == 5.5
    s.record(5.5, 0.2)
    assert s.next_rate() is None and s.best == 5.0
    with pytest.raises(InvalidArgumentError):
        RateSearch(4.0, 2.0, 0.5, 0.9)
    with pytest.raises(InvalidArgumentError):
        RateSearch(1.0, 2.0, 0.5, 1.5)
