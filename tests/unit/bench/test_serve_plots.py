"""The bench's plot: lines against rate for a sweep, labelled bars when only one rate ran."""

from __future__ import annotations

import asyncio

from matplotlib.container import BarContainer
from matplotlib.figure import Figure

from pdserve_bench.serve.metrics import Slo
from pdserve_bench.serve.mixes import SHORT_ONLY
from pdserve_bench.serve.plots import draw, render_png
from pdserve_bench.serve.sweep import RunResult, run_all
from pdserve_bench.serve.workload import Load

from .fakes import FakeTarget


def _run(rates: list[float]) -> tuple[RunResult, list[str]]:
    targets = [FakeTarget("a"), FakeTarget("b", lambda r: 0.5)]
    load = Load(1000, mix=SHORT_ONLY, num_requests=6)
    result = asyncio.run(
        run_all(targets, load, rates=rates, search=None, slo=Slo(), request_timeout_s=30.0)
    )
    return result, [t.label for t in targets]


def test_one_rate_draws_a_labelled_bar_per_target() -> None:
    result, labels = _run([50.0])
    fig = Figure()
    draw(fig, result, labels, slo=Slo(), goal=0.9)
    for ax in fig.axes:
        bars = [c for c in ax.containers if isinstance(c, BarContainer)]
        assert bars and all(len(c) == len(labels) for c in bars), ax.get_title()
        assert [t.get_text() for t in ax.get_xticklabels()] == labels
        assert len(ax.texts) == sum(len(c) for c in bars)  # every bar carries its value
        assert not ax.lines or all(len(line.get_xdata()) == 2 for line in ax.lines)  # SLOs
        assert "at 50 requests/s" in ax.get_title()
    assert render_png(result, labels, slo=Slo(), goal=0.9).startswith(b"\x89PNG")


def test_a_sweep_draws_a_line_per_target_against_rate() -> None:
    result, labels = _run([50.0, 100.0])
    fig = Figure()
    draw(fig, result, labels, slo=Slo(), goal=0.9)
    for ax in fig.axes:
        assert not ax.containers, ax.get_title()
        series = [ln for ln in ax.lines if list(ln.get_xdata()) == [50.0, 100.0]]
        assert len(series) >= len(labels), ax.get_title()
