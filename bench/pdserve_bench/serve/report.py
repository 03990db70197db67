"""The run's report: a table per target, a side-by-side view, the search's answers, and the
JSON document (every request record, every summary, the configuration and the machine)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pdserve_bench.serve.metrics import Percentiles, PointSummary, Slo
from pdserve_bench.serve.sweep import PointResult, RunResult
from pdserve_bench.serve.targets import Target
from pdserve_bench.tables import format_table

JSON_VERSION = 1

SUMMARY_HEAD = [
    "req/s", "sent", "ok", "rejected", "failed", "admitted+failed", "goodput",
    "TTFT p50 s", "p90", "p99", "ITL p50 ms", "p90", "p99", "TPOT p50 ms", "p99",
    "e2e p50 s", "p99", "tok/s",
]  # fmt: skip


def rate_text(rate: float | None) -> str:
    """A point's rate as shown: ``4``, or ``-`` (one burst, or a trace at its own pace)."""
    return "-" if rate is None else f"{rate:g}"


def _num(v: float | None, scale: float = 1.0) -> str:
    if v is None:
        return "-"
    v *= scale
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def _pcts(p: Percentiles | None, scale: float, which: Sequence[str]) -> list[str]:
    return ["-" if p is None else _num(getattr(p, q), scale) for q in which]


def _share(count: int, of: int) -> str:
    return f"{count} ({count / of:.0%})" if of else str(count)


def summary_row(rate: float | None, s: PointSummary) -> list[str]:
    return [
        rate_text(rate), str(s.sent), str(s.ok), _share(s.rejected, s.sent),
        _share(s.errors, s.sent), str(s.admitted_failed), f"{s.goodput:.2f}",
        *_pcts(s.ttft, 1.0, ("p50", "p90", "p99")),
        *_pcts(s.itl, 1e3, ("p50", "p90", "p99")),
        *_pcts(s.tpot, 1e3, ("p50", "p99")),
        *_pcts(s.e2e, 1.0, ("p50", "p99")),
        _num(s.throughput_tok_s),
    ]  # fmt: skip


def by_target(result: RunResult) -> dict[str, list[PointResult]]:
    """Each target's points, by rate (points without a rate last)."""
    out: dict[str, list[PointResult]] = {}
    for p in result.points:
        out.setdefault(p.target, []).append(p)
    for points in out.values():
        points.sort(key=lambda p: (p.rate is None, p.rate or 0.0))
    return out


def search_line(label: str, result: RunResult) -> str | None:
    s = result.searches.get(label)
    if s is None:
        return None
    doc = s.to_json()
    best = doc["best_rate"]
    goal = f"goodput >= {s.goal:g}"
    if best is None:
        return f"highest rate with {goal}: none (below {s.low:g} req/s)"
    if doc["capped"]:
        return f"highest rate with {goal}: at least {best:g} req/s (the top of the range)"
    return f"highest rate with {goal}: {best:g} req/s (missed at {doc['lowest_failing_rate']:g})"


def format_report(result: RunResult, targets: Sequence[Target], *, slo: Slo, headline: str) -> str:
    """Everything printed at the end of a run."""
    out = [headline, f"SLO: TTFT <= {slo.ttft_s:g} s, per-request p99 ITL <= "
           f"{slo.itl_s * 1e3:g} ms; warm-up requests excluded", ""]  # fmt: skip
    points = by_target(result)
    for t in targets:
        out.append(f"{t.label}: {_describe(t)}")
        rows = [summary_row(p.rate, p.summary) for p in points.get(t.label, [])]
        out += format_table([SUMMARY_HEAD, *rows]) if rows else ["  (no points)"]
        out += class_rows(points.get(t.label, []))
        line = search_line(t.label, result)
        if line is not None:
            out.append(line)
        if t.label in result.down:
            out.append(f"dropped: {result.down[t.label].splitlines()[0]}")
        out.append("")
    if len(points) > 1:
        out += ["side by side:", *format_table(side_by_side(result, [t.label for t in targets]))]
    costs = feature_costs(result, targets)
    if len(costs) > 1:
        out += ["", "cost of the features (each against the same server's plain requests):",
                *format_table(costs)]  # fmt: skip
    return "\n".join(out).rstrip() + "\n"


def _endpoint(t: Target) -> str:
    """What server a target sends to, whatever its features: the URL or address, or the
    cluster it started (two clusters of one spec are the same server, started twice)."""
    d = t.describe()
    if d.get("kind") == "pdserve-cluster":
        return json.dumps(d["cluster"], sort_keys=True)
    return str(d.get("url") or d.get("address"))


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def feature_costs(result: RunResult, targets: Sequence[Target]) -> list[list[str]]:
    """Per target with features, per rate: its output tokens/s, TPOT, ITL and TTFT p50 over
    those of the plain target of the same server at the same rate (header row first)."""
    plain = {_endpoint(t): t.label for t in targets if t.features.name == "plain"}
    cell = {(p.target, p.rate): p.summary for p in result.points}
    rows = [["target", "against", "req/s", "tok/s", "TPOT p50", "ITL p50", "TTFT p50",
             "tokens per answer"]]  # fmt: skip
    points = by_target(result)
    for t in targets:
        base = plain.get(_endpoint(t))
        if t.features.name == "plain" or base is None:
            continue
        for p in points.get(t.label, []):
            b = cell.get((base, p.rate))
            if b is None:
                continue
            s = p.summary
            rows.append([
                f"{t.label} ({t.features.name})", base, rate_text(p.rate),
                _ratio(s.throughput_tok_s, b.throughput_tok_s),
                *(_ratio(_p50(getattr(s, m)), _p50(getattr(b, m))) for m in LATENCIES),
                f"{_per_answer(s)} / {_per_answer(b)}",
            ])  # fmt: skip
    return rows


LATENCIES = ("tpot", "itl", "ttft")


def _p50(p: Percentiles | None) -> float | None:
    return None if p is None else p.p50


def _per_answer(s: PointSummary) -> str:
    return f"{s.output_tokens / s.ok:.0f}" if s.ok else "-"


def class_rows(points: Sequence[PointResult]) -> list[str]:
    """Per request class (when a point has several) and the prefix hit rate (when reported):
    one line per point."""
    out = []
    for p in points:
        s = p.summary
        parts = [
            f"{kind} {c.sent} sent, goodput {c.goodput:.2f}, TTFT p50/p99 "
            f"{'/'.join(_pcts(c.ttft, 1.0, ('p50', 'p99')))} s"
            for kind, c in (s.classes or {}).items()
        ]
        if len(parts) < 2:
            parts = []
        if s.prefix_hit_rate is not None:
            parts.append(f"prefix hit rate {s.prefix_hit_rate:.2f}")
        if parts:
            out.append(f"  {rate_text(p.rate)} req/s: " + "; ".join(parts))
    return out


def side_by_side(result: RunResult, labels: Sequence[str]) -> list[list[str]]:
    """One row per rate (after the header): goodput, TTFT p99 and ITL p99 of every target."""
    cell: dict[tuple[str, float | None], PointSummary] = {
        (p.target, p.rate): p.summary for p in result.points
    }
    rates = sorted({p.rate for p in result.points}, key=lambda r: (r is None, r or 0.0))
    head = ["req/s"]
    for label in labels:
        head += [f"{label} goodput", "TTFT p99 s", "ITL p99 ms"]
    rows = [head]
    for rate in rates:
        row = [rate_text(rate)]
        for label in labels:
            s = cell.get((label, rate))
            if s is None:
                row += ["-", "-", "-"]
            else:
                row += [f"{s.goodput:.2f}", *_pcts(s.ttft, 1.0, ("p99",)),
                        *_pcts(s.itl, 1e3, ("p99",))]  # fmt: skip
        rows.append(row)
    return rows


def _describe(t: Target) -> str:
    what = _what(t)
    if t.features.name == "plain":
        return what
    return f"{what}\n  requests carry: {t.features.summary}"


def _what(t: Target) -> str:
    d = t.describe()
    if d.get("kind") == "pdserve-cluster":
        c = d["cluster"]
        workers = (
            f"{c['decode']} mixed workers" if c["mode"] == "colocated"
            else f"{c['prefill']} prefill + {c['decode']} mixed" if c["mode"] == "conditional"
            else f"{c['prefill']} prefill + {c['decode']} decode"
        )  # fmt: skip
        extra = " ".join([*c["worker_args"], *c.get("scheduler_args", []),
                          *c.get("router_args", [])])  # fmt: skip
        if any(c.get("duties", [])):
            extra += " duties " + ",".join(d or "any" for d in c["duties"])
        if any(c.get("lanes", [])):
            extra += " lanes " + ",".join(lane or "any" for lane in c["lanes"])
        if c.get("planner_args") is not None:
            extra += " + planner " + " ".join(c["planner_args"])
        backend = c.get("backend", "torch")
        kind = c["mode"] if backend == "torch" else f"{c['mode']} on {backend}"
        rss = ", ".join(f"{n} {mb}" for n, mb in d.get("rss_mb", {}).items())
        memory = f"\n  RSS MB: {rss}" if rss else ""
        shape = f"{workers}{', ' + extra if extra else ''}"
        return f"pdserve {kind} ({shape}) at {d['address']}{memory}"
    if d.get("kind") == "openai":
        return f"OpenAI-compatible {d['url']} (model {d['model']})"
    return f"pdserve router {d.get('address')}"


def to_json(
    result: RunResult,
    targets: Sequence[Target],
    *,
    config: dict[str, Any],
    machine: dict[str, Any],
) -> dict[str, Any]:
    """The whole run as one JSON document."""
    return {
        "version": JSON_VERSION,
        "config": config,
        "machine": machine,
        "targets": [{"label": t.label, **t.describe()} for t in targets],
        "points": [p.to_json() for p in result.points],
        "search": {label: s.to_json() for label, s in result.searches.items()},
        "dropped": result.down,
    }
