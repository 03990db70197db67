"""Whether each request's trace has arrived whole.

One request's spans come from several processes (router, scheduler, workers), each exporting
in batches on its own schedule, so a report read right after the load can see a request's
``router.request`` without the worker spans of its decode, or worker spans whose router
batch has not been written yet. ``gaps`` names what is still missing per trace: the
``router.request`` of a trace that holds stage spans, or the ``decode.generate`` of a request
that finished without error (every served request decodes, colocated or not).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.telemetry.record import SpanRecord
from pdserve.telemetry.spans import DECODE_GENERATE, E2E_SPAN, ROUTER_RELEASE, STAGES

_STAGES = frozenset(STAGES)


@dataclass(frozen=True, slots=True)
class Gap:
    """A trace and the spans it still lacks."""

    trace_id: str
    missing: tuple[str, ...]


def gaps(spans: Iterable[SpanRecord]) -> list[Gap]:
    """The traces of ``spans`` that are not whole yet (see the module docstring)."""
    by_trace: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    out = []
    for trace_id, members in sorted(by_trace.items()):
        names = [s.name for s in members]
        if ROUTER_RELEASE in names:
            continue  # a release's own trace: no request in it
        served = [s for s in members if s.name == E2E_SPAN and s.status != "ERROR"]
        if E2E_SPAN not in names:
            if _STAGES.intersection(names):
                out.append(Gap(trace_id, (E2E_SPAN,)))
        elif names.count(DECODE_GENERATE) < len(served):
            out.append(Gap(trace_id, (DECODE_GENERATE,)))
    return out


def describe(found: list[Gap], waited_s: float, shown: int = 5) -> str:
    """One line on the traces still incomplete after waiting ``waited_s``."""
    parts = [f"{g.trace_id} lacks {', '.join(g.missing)}" for g in found[:shown]]
    more = f" and {len(found) - shown} more" if len(found) > shown else ""
    return (
        f"{len(found)} trace(s) still incomplete after waiting {waited_s:g} s, left out of "
        f"the breakdown: {'; '.join(parts)}{more}"
    )
