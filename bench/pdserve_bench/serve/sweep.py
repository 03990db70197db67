"""The run: every point on every target, interleaved, and the search for the highest rate
whose goodput stays at or above the target.

Points run one at a time, each target in turn at the same rate before the next rate (rate 1:
A then B, rate 2: A then B, ...), so drift in the machine's load hits every target alike.
The fixed rates (``rates``) come first; then, with a ``RateSearch`` per target, rounds in
which each target still searching runs its next probe.

The search assumes goodput does not rise with the rate. It probes the low bound (goodput
below target there: no answer), then the high bound (at or above: the answer is the high
bound), then bisects until the bracket is at most ``resolution`` wide; the answer is the
highest rate probed whose goodput met the target below the lowest that missed it. Fixed-rate
points already run narrow the bracket before the first probe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import InvalidArgumentError
from pdserve_bench.serve.metrics import PointSummary, Slo, summarize
from pdserve_bench.serve.records import RequestRecord
from pdserve_bench.serve.runner import Counters, run_point
from pdserve_bench.serve.targets import Target, TargetDownError
from pdserve_bench.serve.timescale import REAL_TIME, TimeScale
from pdserve_bench.serve.workload import Load


@dataclass(slots=True)
class RateSearch:
    """Bisection for the highest rate with goodput >= ``goal`` in ``[low, high]``."""

    low: float
    high: float
    resolution: float
    goal: float
    probes: dict[float, float] = field(default_factory=dict)
    """Every rate measured (fixed points included) -> its goodput."""

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high:
            raise InvalidArgumentError("search_range", f"need 0 < low < high, got {self}")
        if not self.resolution > 0:
            raise InvalidArgumentError("search_resolution", "must be > 0")
        if not 0 < self.goal <= 1:
            raise InvalidArgumentError("goodput_target", f"must be in (0, 1], got {self.goal}")

    def record(self, rate: float, goodput: float) -> None:
        self.probes[rate] = goodput

    def _bracket(self) -> tuple[float | None, float | None]:
        """(highest passing rate below the lowest failing one, that lowest failing rate)."""
        failing = [r for r, g in self.probes.items() if g < self.goal]
        lowest_fail = min(failing, default=None)
        passing = [
            r for r, g in self.probes.items()
            if g >= self.goal and (lowest_fail is None or r < lowest_fail)
        ]  # fmt: skip
        return max(passing, default=None), lowest_fail

    def next_rate(self) -> float | None:
        """The next rate to probe; None once the answer is known."""
        good, bad = self._bracket()
        if good is None:
            if bad is not None and bad <= self.low:
                return None  # the low bound (or below) already misses the target
            return self.low
        if bad is None:
            return None if good >= self.high else self.high
        if bad - good <= self.resolution:
            return None
        return round((good + bad) / 2, 6)

    @property
    def best(self) -> float | None:
        """The answer: None when even the lowest probe missed the target."""
        return self._bracket()[0]

    def to_json(self) -> dict[str, Any]:
        good, bad = self._bracket()
        return {
            "best_rate": good,
            "lowest_failing_rate": bad,
            "capped": bad is None and good is not None,
            "range": [self.low, self.high],
            "resolution": self.resolution,
            "goodput_target": self.goal,
            "probes": [{"rate": r, "goodput": g} for r, g in sorted(self.probes.items())],
        }


@dataclass(slots=True)
class PointResult:
    """One (target, rate) point."""

    target: str
    rate: float | None
    records: list[RequestRecord]
    summary: PointSummary
    load_1min: float | None
    """The machine's 1-minute load average when the point started."""
    phase: str
    """``sweep`` (a fixed rate) or ``search``."""

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "rate": self.rate,
            "phase": self.phase,
            "load_1min_start": self.load_1min,
            "summary": self.summary.to_json(),
            "records": [r.to_json() for r in self.records],
        }


@dataclass(slots=True)
class RunResult:
    points: list[PointResult] = field(default_factory=list)
    searches: dict[str, RateSearch] = field(default_factory=dict)
    down: dict[str, str] = field(default_factory=dict)
    """Targets dropped mid-run -> why."""


@dataclass(frozen=True, slots=True)
class SearchSpec:
    low: float
    high: float
    resolution: float
    goal: float


ProgressHook = Callable[[str, float | None, Counters], None]
"""(target label, rate, live counts of the point)."""


async def run_all(
    targets: Sequence[Target],
    load: Load,
    *,
    rates: Sequence[float | None],
    search: SearchSpec | None,
    slo: Slo,
    request_timeout_s: float,
    time_scale: TimeScale = REAL_TIME,
    load_average: Callable[[], float | None] = lambda: None,
    on_progress: ProgressHook = lambda _t, _r, _c: None,
    log: Callable[[str], None] = lambda _m: None,
) -> RunResult:
    """Every fixed rate on every target, then the search rounds; see the module docstring.
    Rates, SLOs and ``request_timeout_s`` are in ``time_scale``'s modelled time, and so are
    the records and summaries."""
    result = RunResult()
    live = list(targets)

    async def point(target: Target, rate: float | None, phase: str) -> PointResult | None:
        try:
            await target.begin_point(rate)
        except TargetDownError as e:
            log(f"{target.label}: dropped from the run: {e}")
            result.down[target.label] = str(e)
            live.remove(target)
            return None
        started_load = load_average()
        sent = await run_point(
            target, time_scale.real_plan(load.plan(rate, salt=target.features.salt)),
            request_timeout_s=time_scale.real_s(request_timeout_s),
            on_change=lambda c: on_progress(target.label, rate, c),
        )  # fmt: skip
        records = time_scale.modelled_records(sent)
        res = PointResult(target.label, rate, records, summarize(records, slo), started_load, phase)
        result.points.append(res)
        return res

    for rate in rates:
        for target in list(live):
            await point(target, rate, "sweep")
    if search is None:
        return result
    for target in live:
        s = RateSearch(search.low, search.high, search.resolution, search.goal)
        for p in result.points:
            if p.target == target.label and p.rate is not None:
                s.record(p.rate, p.summary.goodput)
        result.searches[target.label] = s
    while True:
        todo = [
            (t, r) for t in list(live) if (r := result.searches[t.label].next_rate()) is not None
        ]
        if not todo:
            return result
        for target, rate in todo:
            res = await point(target, rate, "search")
            if res is not None:
                result.searches[target.label].record(rate, res.summary.goodput)
