"""The PNG waterfall of a latency breakdown: one row per request, one coloured bar per stage.

Rendered with matplotlib's Agg canvas directly (no pyplot), so no backend or figure state is
left behind in the process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pdserve.telemetry.breakdown import Breakdown
from pdserve.telemetry.html_report import E2E_COLOUR, stage_colours
from pdserve.telemetry.spans import E2E_SPAN, STAGES


def write_breakdown_png(
    breakdown: Breakdown,
    path: str | os.PathLike[str],
    *,
    max_rows: int = 60,
    stages: Sequence[str] = STAGES,
) -> int:
    """Draw the first ``max_rows`` requests (by start time) to ``path``; returns rows drawn.

    Each row is a request: a grey bar for end to end, and on top of it each stage span at its
    offset from the request's start, so overlapping stages (KV send and receive) show as such.
    """
    rows = breakdown.requests[:max_rows]
    colours = stage_colours(stages)
    fig = Figure(figsize=(11.0, 1.8 + 0.32 * max(len(rows), 1)), dpi=100)
    FigureCanvasAgg(fig)  # attaches itself to fig; savefig then renders with Agg
    ax = fig.add_subplot()
    height = 0.8
    for y, req in enumerate(rows):
        ax.barh(y, req.e2e_ns / 1e6, left=0.0, height=height, color=E2E_COLOUR)
        for interval in req.intervals:
            ax.barh(
                y,
                interval.duration_ns / 1e6,
                left=interval.offset_ns / 1e6,
                height=height * 0.6,
                color=colours.get(interval.stage, "#000000"),
            )
    ax.set_yticks(range(len(rows)), [r.request_id[:24] for r in rows], fontsize=7)
    ax.invert_yaxis()  # first request on top, like a trace waterfall
    ax.set_xlabel("milliseconds since the router accepted the request")
    shown = f"{len(rows)} of {len(breakdown.requests)}" if rows else "no"
    ax.set_title(f"pdserve latency breakdown ({shown} requests)")
    seen = {i.stage for r in rows for i in r.intervals}
    handles = [Patch(color=E2E_COLOUR, label=E2E_SPAN)] + [
        Patch(color=colours[s], label=s) for s in stages if s in seen
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")
    return len(rows)
