"""Modelled time: a run on simulated clusters slowed down ``--sim-time-scale`` times.

A sim worker started with ``--sim-time-scale K`` makes every modelled second last ``K`` real
ones, so that many simulated workers on a small machine keep up with their model. What the
user gives (offered rates, SLOs, the request timeout) and what the report shows are then in
modelled time; only the run itself is real. Two places convert, and nothing else needs to
know: a point's plan is stretched to real time before it is sent (arrivals ``K`` times
later: the real offered rate is ``rate / K``), and its records are shrunk back to modelled
time before anything is computed from them (latencies ``/ K``, so that judging them against
the SLO is judging the real ones against ``SLO * K``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError
from pdserve_bench.serve.records import RequestRecord
from pdserve_bench.serve.workload import PointPlan

FLAG = "--sim-time-scale"


@dataclass(frozen=True, slots=True)
class TimeScale:
    """Real seconds per modelled second of the clusters under test (1: real time)."""

    factor: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise InvalidArgumentError(FLAG, f"must be a positive number, got {self.factor}")

    @property
    def is_real(self) -> bool:
        return self.factor == 1.0

    def real_plan(self, plan: PointPlan) -> PointPlan:
        """``plan`` (in modelled time) as sent: every arrival ``factor`` times later."""
        if self.is_real:
            return plan
        return dataclasses.replace(
            plan,
            requests=tuple(
                dataclasses.replace(r, arrival_s=r.arrival_s * self.factor) for r in plan.requests
            ),
        )

    def real_s(self, modelled_s: float) -> float:
        """A duration the user gave (modelled) as the real time to allow."""
        return modelled_s * self.factor

    def modelled_records(self, records: Sequence[RequestRecord]) -> list[RequestRecord]:
        """``records`` (real seconds) with every time in modelled seconds: new records."""
        if self.is_real:
            return list(records)
        k = self.factor

        def scaled(t: float | None) -> float | None:
            return None if t is None else t / k

        return [
            dataclasses.replace(
                r,
                scheduled_s=r.scheduled_s / k,
                send_s=scaled(r.send_s),
                chunk_s=[t / k for t in r.chunk_s],
                chunk_tokens=list(r.chunk_tokens),
                end_s=scaled(r.end_s),
            )
            for r in records
        ]

    def note(self) -> str | None:
        """What the report says of the units; None in real time."""
        if self.is_real:
            return None
        k = f"{self.factor:g}"
        return (
            f"sim time scale {k}: rates and latencies are in modelled time; real rates were 1/{k}"
        )


REAL_TIME = TimeScale()
"""No scaling: every target runs in real time."""
