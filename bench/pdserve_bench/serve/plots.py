"""Latency and goodput against offered rate, one line per target: a PNG, and a self-contained
HTML page with the PNG inlined and the tables.

Rendered with matplotlib's Agg canvas directly (no pyplot), as ``telemetry.chart`` does.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Sequence
from html import escape

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from pdserve_bench.serve.metrics import PointSummary, Slo
from pdserve_bench.serve.report import (
    SUMMARY_HEAD,
    by_target,
    search_line,
    side_by_side,
    summary_row,
)
from pdserve_bench.serve.sweep import RunResult

Getter = Callable[[PointSummary], float | None]
Rated = Sequence[tuple[float, PointSummary]]


def _series(points: Rated, get: Getter) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for rate, s in points:
        y = get(s)
        if y is not None:
            xs.append(rate)
            ys.append(y)
    return xs, ys


def render_png(result: RunResult, labels: Sequence[str], *, slo: Slo, goal: float) -> bytes:
    """The four panels (TTFT p50/p99, ITL p99, goodput, throughput) as PNG bytes (``draw``)."""
    fig = Figure(figsize=(12.0, 8.0), dpi=100)
    FigureCanvasAgg(fig)
    draw(fig, result, labels, slo=slo, goal=goal)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def draw(fig: Figure, result: RunResult, labels: Sequence[str], *, slo: Slo, goal: float) -> None:
    """The four panels on ``fig``: lines against rate, or labelled bars per target when the
    run measured a single rate (a line of one point shows nothing)."""
    ax_ttft, ax_itl, ax_good, ax_tput = fig.subplots(2, 2).flat
    points = by_target(result)
    rates = {p.rate for rated in points.values() for p in rated if p.rate is not None}
    if len(rates) <= 1:
        _bars(fig, result, labels, slo=slo, goal=goal)
        return

    def line(ax: Axes, rated: Rated, get: Getter, style: str, colour: str, name: str) -> None:
        xs, ys = _series(rated, get)
        if xs:
            ax.plot(xs, ys, style, color=colour, label=name, marker="o", markersize=4)

    for i, label in enumerate(labels):
        rated = [(p.rate, p.summary) for p in points.get(label, []) if p.rate is not None]
        c = f"C{i % 10}"
        line(ax_ttft, rated, lambda s: s.ttft.p50 if s.ttft else None, "-", c, f"{label} p50")
        line(ax_ttft, rated, lambda s: s.ttft.p99 if s.ttft else None, "--", c, f"{label} p99")
        line(ax_itl, rated, lambda s: s.itl.p99 * 1e3 if s.itl else None, "-", c, f"{label} p99")
        line(ax_good, rated, lambda s: s.goodput, "-", c, label)
        line(ax_tput, rated, lambda s: s.throughput_tok_s, "-", c, label)
    ax_ttft.axhline(slo.ttft_s, color="grey", linewidth=0.8, linestyle=":", label="SLO")
    ax_itl.axhline(slo.itl_s * 1e3, color="grey", linewidth=0.8, linestyle=":", label="SLO")
    ax_good.axhline(goal, color="grey", linewidth=0.8, linestyle=":", label="target")
    for ax in (ax_ttft, ax_itl):  # latencies span orders of magnitude once a server saturates
        ax.set_yscale("log")
    titles = (
        (ax_ttft, "TTFT (s)"), (ax_itl, "inter-token latency p99 (ms)"),
        (ax_good, "goodput (share within both SLOs)"), (ax_tput, "output tokens/s"),
    )  # fmt: skip
    for ax, title in titles:
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("offered rate (requests/s)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax_good.set_ylim(-0.02, 1.02)


def _bars(fig: Figure, result: RunResult, labels: Sequence[str], *, slo: Slo, goal: float) -> None:
    """One rate: per panel a bar per target (p50 and p99 side by side for TTFT), each bar
    labelled with its value, the SLO or target as a dotted line."""
    points = by_target(result)
    only = {label: points[label][0] for label in labels if points.get(label)}
    rate = next((p.rate for p in only.values() if p.rate is not None), None)
    panels: tuple[tuple[str, list[tuple[str, Getter]], float], ...] = (
        ("TTFT (s)", [("p50", lambda s: s.ttft.p50 if s.ttft else None),
                      ("p99", lambda s: s.ttft.p99 if s.ttft else None)], slo.ttft_s),
        ("inter-token latency p99 (ms)",
         [("p99", lambda s: s.itl.p99 * 1e3 if s.itl else None)], slo.itl_s * 1e3),
        ("goodput (share within both SLOs)", [("", lambda s: s.goodput)], goal),
        ("output tokens/s", [("", lambda s: s.throughput_tok_s)], 0.0),
    )  # fmt: skip
    names = list(only)
    for ax, (title, series, line) in zip(fig.axes, panels, strict=True):
        width = 0.8 / len(series)
        for j, (tag, get) in enumerate(series):
            xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(names))]
            ys = [get(only[n].summary) for n in names]
            bars = ax.bar(
                [x for x, y in zip(xs, ys, strict=True) if y is not None],
                [y for y in ys if y is not None],
                width=width * 0.9,
                color=f"C{j}",
                label=tag or None,
            )
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        if line > 0:
            ax.axhline(line, color="grey", linewidth=0.8, linestyle=":", label="SLO/target")
        ax.set_xticks(range(len(names)), names, fontsize=8, rotation=15)
        at = f" at {rate:g} requests/s" if rate is not None else ""
        ax.set_title(f"{title}{at}", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)


_CSS = """
body { font: 13px/1.45 system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 1400px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { padding: 2px 7px; text-align: right; white-space: nowrap; border-bottom: 1px solid #eee; }
th { border-bottom: 1px solid #999; }
pre { background: #f6f6f6; padding: 0.6em; }
"""


def _html_table(rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{escape(c)}</th>" for c in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows[1:]
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(
    result: RunResult, labels: Sequence[str], *, title: str, notes: Sequence[str], png: bytes
) -> str:
    """One page: the notes (configuration), a table per target, the side-by-side view, the
    search answers and the plot."""
    parts = [f"<h1>{escape(title)}</h1>"]
    parts += [f"<p>{escape(n)}</p>" for n in notes]
    points = by_target(result)
    for label in labels:
        rows = [SUMMARY_HEAD, *(summary_row(p.rate, p.summary) for p in points.get(label, []))]
        parts.append(f"<h2>{escape(label)}</h2>{_html_table(rows)}")
        line = search_line(label, result)
        if line is not None:
            parts.append(f"<p>{escape(line)}</p>")
        if label in result.down:
            parts.append(f"<p>dropped:</p><pre>{escape(result.down[label])}</pre>")
    if len(points) > 1:
        parts.append(f"<h2>side by side</h2>{_html_table(side_by_side(result, labels))}")
    data = base64.b64encode(png).decode()
    parts.append(f'<h2>against rate</h2><img alt="latency and goodput vs rate" '
                 f'src="data:image/png;base64,{data}">')  # fmt: skip
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
        + "".join(parts)
        + "</body></html>\n"
    )
