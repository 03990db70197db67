"""Latency breakdown: per-request stage durations and their percentiles across requests.

A request is a ``router.request`` span; its duration is the end-to-end latency. Every stage
span (``spans.STAGES``) of the same trace belongs to it (when a trace holds several
``router.request`` spans, a stage belongs to the one it descends from). A stage recorded more
than once for a request (a retried transfer) counts with its total time.

Stages overlap by design (the KV send and receive stream concurrently with each other), so
their shares of end to end need not add up to 100%.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError
from pdserve.telemetry.record import SpanRecord
from pdserve.telemetry.spans import ATTR_REQUEST_ID, E2E_SPAN, ROUTER_RELEASE, STAGES

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True, slots=True)
class StageInterval:
    """One stage span of a request, placed relative to the request's start."""

    stage: str
    offset_ns: int
    duration_ns: int


@dataclass(frozen=True, slots=True)
class RequestBreakdown:
    """One request: its identity, end-to-end time, and per-stage totals and intervals."""

    trace_id: str
    request_id: str
    start_ns: int
    e2e_ns: int
    stage_ns: dict[str, int]
    intervals: tuple[StageInterval, ...]


@dataclass(frozen=True, slots=True)
class StageStats:
    """Percentiles of one stage over the requests that went through it.

    ``share`` is the stage's summed time over the summed end-to-end time of all requests.
    """

    stage: str
    count: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    share: float


@dataclass(frozen=True, slots=True)
class Breakdown:
    """All requests found, the stats (end to end first, then stages in path order)."""

    requests: tuple[RequestBreakdown, ...]
    stats: tuple[StageStats, ...]
    missing_stages: tuple[str, ...]
    skipped_traces: int
    """Traces holding spans but no ``router.request`` (a router that does not trace); the
    traces of reservation releases (``router.release``) are neither requests nor skipped."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation between closest ranks."""
    if not values:
        raise InvalidArgumentError("values", "percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise InvalidArgumentError("q", f"must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _owner(span: SpanRecord, by_id: dict[str, SpanRecord], roots: set[str]) -> str | None:
    """The id of the ``router.request`` span that ``span`` descends from, if any."""
    seen: set[str] = set()
    current: SpanRecord | None = span
    while current is not None and current.span_id not in seen:
        if current.span_id in roots:
            return current.span_id
        seen.add(current.span_id)
        current = by_id.get(current.parent_id) if current.parent_id else None
    return None


def _requests_of_trace(
    trace_id: str, spans: list[SpanRecord], stages: frozenset[str]
) -> list[RequestBreakdown]:
    roots = [s for s in spans if s.name == E2E_SPAN]
    root_ids = {r.span_id for r in roots}
    by_id = {s.span_id: s for s in spans}
    owned: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        if s.name not in stages:
            continue
        # One request per trace is the normal case: then even a stage whose parent chain is
        # broken (a middle service that does not trace) still belongs to it.
        owner = roots[0].span_id if len(roots) == 1 else _owner(s, by_id, root_ids)
        if owner is not None:
            owned[owner].append(s)
    out: list[RequestBreakdown] = []
    for root in roots:
        members = sorted(owned.get(root.span_id, []), key=lambda s: s.start_ns)
        totals: dict[str, int] = defaultdict(int)
        for s in members:
            totals[s.name] += s.duration_ns
        request_id = root.attributes.get(ATTR_REQUEST_ID)
        out.append(
            RequestBreakdown(
                trace_id=trace_id,
                request_id=str(request_id) if request_id is not None else root.span_id,
                start_ns=root.start_ns,
                e2e_ns=root.duration_ns,
                stage_ns=dict(totals),
                intervals=tuple(
                    StageInterval(s.name, s.start_ns - root.start_ns, s.duration_ns)
                    for s in members
                ),
            )
        )
    return out


def _stats(stage: str, durations_ns: list[int], e2e_total_ns: int) -> StageStats:
    ms = [d / 1e6 for d in durations_ns]
    p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
    return StageStats(
        stage=stage,
        count=len(ms),
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        mean_ms=sum(ms) / len(ms),
        share=sum(durations_ns) / e2e_total_ns if e2e_total_ns > 0 else 0.0,
    )


def compute_breakdown(spans: Iterable[SpanRecord], stages: Sequence[str] = STAGES) -> Breakdown:
    """Group ``spans`` by trace, split each request into ``stages``, and summarise."""
    by_trace: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    stage_set = frozenset(stages)
    requests: list[RequestBreakdown] = []
    skipped = 0
    for trace_id, members in by_trace.items():
        if any(s.name == ROUTER_RELEASE for s in members):
            continue  # a finished request's release, after its call: no stage of it
        found = _requests_of_trace(trace_id, members, stage_set)
        skipped += not found
        requests.extend(found)
    requests.sort(key=lambda r: (r.start_ns, r.trace_id))
    stats: list[StageStats] = []
    missing: list[str] = []
    if requests:
        e2e = [r.e2e_ns for r in requests]
        total = sum(e2e)
        stats.append(_stats(E2E_SPAN, e2e, total))
        for stage in stages:
            durations = [r.stage_ns[stage] for r in requests if stage in r.stage_ns]
            if durations:
                stats.append(_stats(stage, durations, total))
            else:
                missing.append(stage)
    else:
        missing.extend(stages)
    return Breakdown(tuple(requests), tuple(stats), tuple(missing), skipped)
