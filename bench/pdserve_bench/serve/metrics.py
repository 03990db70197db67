"""The statistics of one point, from its request records.

Over the measured requests (warm-up ones left out):

* TTFT: first token-carrying chunk minus send; e2e: end of stream minus send;
  ITL: every gap between consecutive token-carrying chunks, all requests pooled;
  TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request. These over completed requests.
* goodput: the share of *sent* requests that completed with TTFT <= the TTFT SLO and their
  own p99 inter-chunk gap <= the ITL SLO (rejected and failed requests count as not good).
* throughput: output tokens of completed requests over the point's span (first send to last
  end of a measured request).
* admitted then failed: requests the target accepted (not refused) that did not complete.
* per request class (``long``, ``short``, ``turn``, ...): sent, goodput and TTFT, so that one
  class's latency is not hidden in the mix's (a lane's short requests, say).
* prefix hit rate: prompt tokens the target served from its prefix cache over all prompt
  tokens, over completed requests whose target reports it.

Percentiles interpolate linearly between closest ranks (``telemetry.breakdown.percentile``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.errors import InvalidArgumentError
from pdserve.telemetry.breakdown import percentile
from pdserve_bench.serve.records import RequestRecord, Status


@dataclass(frozen=True, slots=True)
class Slo:
    """Per-request service-level objectives (seconds)."""

    ttft_s: float = 3.0
    itl_s: float = 0.150
    """Bound on a request's own p99 gap between streamed chunks."""

    def __post_init__(self) -> None:
        if not self.ttft_s > 0:
            raise InvalidArgumentError("ttft_slo", f"must be > 0, got {self.ttft_s}")
        if not self.itl_s > 0:
            raise InvalidArgumentError("itl_slo", f"must be > 0, got {self.itl_s}")


@dataclass(frozen=True, slots=True)
class Percentiles:
    n: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles | None:
        if not values:
            return None
        return cls(
            len(values),
            statistics.fmean(values),
            percentile(values, 50),
            percentile(values, 90),
            percentile(values, 99),
        )

    def to_json(self) -> dict[str, float]:
        return {"n": self.n, "mean": self.mean, "p50": self.p50, "p90": self.p90, "p99": self.p99}


def is_good(rec: RequestRecord, slo: Slo) -> bool:
    """Completed within both SLOs (a request with fewer than two chunks has no gap to miss)."""
    ttft = rec.ttft_s
    if rec.status is not Status.OK or ttft is None or ttft > slo.ttft_s:
        return False
    gaps = rec.gaps_s
    return not gaps or percentile(gaps, 99) <= slo.itl_s


@dataclass(frozen=True, slots=True)
class ClassSummary:
    """One request class of a point."""

    sent: int
    good: int
    ttft: Percentiles | None

    @property
    def goodput(self) -> float:
        return self.good / self.sent if self.sent else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "good": self.good,
            "goodput": self.goodput,
            "ttft_s": None if self.ttft is None else self.ttft.to_json(),
        }


@dataclass(frozen=True, slots=True)
class PointSummary:
    """Everything the table, the plot and the rate search read of one point."""

    sent: int
    ok: int
    rejected: int
    errors: int
    admitted_failed: int
    good: int
    output_tokens: int
    span_s: float | None
    ttft: Percentiles | None
    itl: Percentiles | None
    tpot: Percentiles | None
    e2e: Percentiles | None
    send_lag: Percentiles | None
    """Actual minus planned send time: the client falling behind its schedule (or, in a
    conversation, a turn waiting for the previous answer)."""
    classes: dict[str, ClassSummary] | None = None
    """Per request class, by name."""
    prefix_hit_rate: float | None = None
    """Cached over all prompt tokens of the completed requests that report it."""

    @property
    def goodput(self) -> float:
        return self.good / self.sent if self.sent else 0.0

    @property
    def rejected_share(self) -> float:
        return self.rejected / self.sent if self.sent else 0.0

    @property
    def error_share(self) -> float:
        return self.errors / self.sent if self.sent else 0.0

    @property
    def throughput_tok_s(self) -> float | None:
        return self.output_tokens / self.span_s if self.span_s else None

    @property
    def good_per_s(self) -> float | None:
        """Good requests per second of the span."""
        return self.good / self.span_s if self.span_s else None

    def to_json(self) -> dict[str, Any]:
        def stats(p: Percentiles | None) -> dict[str, float] | None:
            return None if p is None else p.to_json()

        return {
            "sent": self.sent,
            "ok": self.ok,
            "rejected": self.rejected,
            "errors": self.errors,
            "admitted_failed": self.admitted_failed,
            "good": self.good,
            "goodput": self.goodput,
            "rejected_share": self.rejected_share,
            "error_share": self.error_share,
            "output_tokens": self.output_tokens,
            "span_s": self.span_s,
            "throughput_tok_s": self.throughput_tok_s,
            "good_per_s": self.good_per_s,
            "ttft_s": stats(self.ttft),
            "itl_s": stats(self.itl),
            "tpot_s": stats(self.tpot),
            "e2e_s": stats(self.e2e),
            "send_lag_s": stats(self.send_lag),
            "classes": {k: c.to_json() for k, c in (self.classes or {}).items()},
            "prefix_hit_rate": self.prefix_hit_rate,
        }


def summarize(records: Sequence[RequestRecord], slo: Slo) -> PointSummary:
    """The statistics of the measured (non-warm-up) requests of one point."""
    measured = [r for r in records if not r.warmup]
    done = [r for r in measured if r.status is Status.OK]
    failed = [r for r in measured if r.status is Status.ERROR]
    sends = [r.send_s for r in measured if r.send_s is not None]
    ends = [r.end_s for r in measured if r.end_s is not None]
    span = max(ends) - min(sends) if sends and ends else None
    return PointSummary(
        sent=len(measured),
        ok=len(done),
        rejected=sum(r.status is Status.REJECTED for r in measured),
        errors=len(failed),
        admitted_failed=sum(r.admitted for r in failed),
        good=sum(is_good(r, slo) for r in measured),
        output_tokens=sum(r.output_tokens for r in done),
        span_s=span if span is not None and span > 0 else None,
        ttft=Percentiles.of([t for r in done if (t := r.ttft_s) is not None]),
        itl=Percentiles.of([g for r in done for g in r.gaps_s]),
        tpot=Percentiles.of([t for r in done if (t := r.tpot_s) is not None]),
        e2e=Percentiles.of([t for r in done if (t := r.e2e_s) is not None]),
        send_lag=Percentiles.of(
            [r.send_s - r.scheduled_s for r in measured if r.send_s is not None]
        ),
        classes=_classes(measured, slo),
        prefix_hit_rate=_hit_rate(done),
    )


def _classes(measured: Sequence[RequestRecord], slo: Slo) -> dict[str, ClassSummary]:
    out: dict[str, ClassSummary] = {}
    for kind in sorted({r.kind for r in measured}):
        of = [r for r in measured if r.kind == kind]
        ok = [r for r in of if r.status is Status.OK]
        out[kind] = ClassSummary(
            len(of),
            sum(is_good(r, slo) for r in of),
            Percentiles.of([t for r in ok if (t := r.ttft_s) is not None]),
        )
    return out


def _hit_rate(done: Sequence[RequestRecord]) -> float | None:
    reporting = [r for r in done if r.cached_tokens is not None and r.prompt_tokens > 0]
    prompt = sum(r.prompt_tokens for r in reporting)
    return sum(r.cached_tokens or 0 for r in reporting) / prompt if prompt else None
