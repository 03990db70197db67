"""The self-contained HTML page of a latency breakdown: stats table plus a per-request waterfall.

One file, no scripts, no external style sheets or fonts: bars are absolutely positioned
``<span>`` elements sized in percent of the slowest shown request, coloured as in the PNG.
Hovering a bar shows the stage and its duration (``title``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from html import escape
from pathlib import Path

from pdserve.telemetry.breakdown import Breakdown, RequestBreakdown
from pdserve.telemetry.spans import E2E_SPAN, STAGES

# matplotlib's "tab10" colours with its grey replaced by Dark2's green (grey is end to end);
# the PNG uses the same table so both outputs colour a stage alike.
_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#1b9e77",
)  # fmt: skip
E2E_COLOUR = "#d9d9d9"

_STYLE = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { padding: 2px 8px; text-align: right; white-space: nowrap; }
th:first-child, td:first-child { text-align: left; }
thead th { border-bottom: 1px solid #888; }
.legend span { display: inline-block; margin-right: 1em; }
.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
.track { position: relative; width: 640px; height: 16px; }
.seg { position: absolute; height: 10px; top: 3px; min-width: 1px; }
.seg.e2e { height: 16px; top: 0; }
tr.req td.bar { padding: 1px 8px; }
"""


def stage_colours(stages: Sequence[str] = STAGES) -> dict[str, str]:
    """A fixed colour per stage, by position in ``stages`` (the palette repeats past ten)."""
    return {stage: _PALETTE[i % len(_PALETTE)] for i, stage in enumerate(stages)}


def _pct(value_ns: int, scale_ns: int) -> str:
    return f"{100.0 * value_ns / scale_ns:.3f}%" if scale_ns > 0 else "0%"


def _request_row(req: RequestBreakdown, scale_ns: int, colours: dict[str, str]) -> str:
    segs = [
        f'<span class="seg e2e" style="left:0;width:{_pct(req.e2e_ns, scale_ns)};'
        f'background:{E2E_COLOUR}" title="{E2E_SPAN}: {req.e2e_ns / 1e6:.3f} ms"></span>'
    ]
    for i in req.intervals:
        colour = colours.get(i.stage, "#000000")
        segs.append(
            f'<span class="seg" style="left:{_pct(i.offset_ns, scale_ns)};'
            f'width:{_pct(i.duration_ns, scale_ns)};background:{colour}" '
            f'title="{escape(i.stage)}: {i.duration_ns / 1e6:.3f} ms"></span>'
        )
    return (
        f'<tr class="req"><td>{escape(req.request_id)}</td>'
        f"<td>{req.e2e_ns / 1e6:.3f}</td>"
        f'<td class="bar"><div class="track">{"".join(segs)}</div></td></tr>'
    )


def render_breakdown_html(
    breakdown: Breakdown,
    *,
    source: str = "",
    max_rows: int = 1000,
    stages: Sequence[str] = STAGES,
) -> str:
    """The whole page as a string; the waterfall shows the first ``max_rows`` requests."""
    colours = stage_colours(stages)
    rows = breakdown.requests[:max_rows]
    scale_ns = max((r.e2e_ns for r in rows), default=0)
    stat_rows = "".join(
        f"<tr><td>{escape(s.stage)}</td><td>{s.count}</td><td>{s.p50_ms:.3f}</td>"
        f"<td>{s.p90_ms:.3f}</td><td>{s.p99_ms:.3f}</td><td>{s.mean_ms:.3f}</td>"
        f"<td>{100.0 * s.share:.1f}%</td></tr>"
        for s in breakdown.stats
    )
    legend = "".join(
        f'<span><i class="swatch" style="background:{colour}"></i>{escape(stage)}</span>'
        for stage, colour in [(E2E_SPAN, E2E_COLOUR), *colours.items()]
    )
    notes = []
    if breakdown.missing_stages:
        notes.append("stages not seen: " + ", ".join(breakdown.missing_stages))
    if breakdown.skipped_traces:
        notes.append(f"{breakdown.skipped_traces} trace(s) without {E2E_SPAN} skipped")
    if len(rows) < len(breakdown.requests):
        notes.append(f"waterfall shows the first {len(rows)} of {len(breakdown.requests)}")
    note_html = "".join(f"<p>{escape(n)}</p>" for n in notes)
    request_rows = "".join(_request_row(r, scale_ns, colours) for r in rows)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>pdserve latency breakdown</title><style>{_STYLE}</style></head><body>"
        f"<h1>pdserve latency breakdown</h1><p>{len(breakdown.requests)} requests"
        f"{' from ' + escape(source) if source else ''}</p>{note_html}"
        "<h2>Per-stage latency (ms)</h2><table><thead><tr><th>stage</th><th>n</th>"
        "<th>p50</th><th>p90</th><th>p99</th><th>mean</th><th>share of e2e</th></tr></thead>"
        f"<tbody>{stat_rows}</tbody></table>"
        f'<h2>Requests</h2><div class="legend">{legend}</div>'
        f"<p>bar width: 100% = {scale_ns / 1e6:.3f} ms</p>"
        "<table><thead><tr><th>request</th><th>e2e ms</th><th>stages</th></tr></thead>"
        f"<tbody>{request_rows}</tbody></table></body></html>\n"
    )


def write_breakdown_html(
    breakdown: Breakdown,
    path: str | os.PathLike[str],
    *,
    source: str = "",
    max_rows: int = 1000,
    stages: Sequence[str] = STAGES,
) -> int:
    """Write ``render_breakdown_html`` to ``path``; returns the request rows written."""
    Path(path).write_text(
        render_breakdown_html(breakdown, source=source, max_rows=max_rows, stages=stages),
        encoding="utf-8",
    )
    return min(len(breakdown.requests), max_rows)
