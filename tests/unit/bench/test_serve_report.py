"""`bench serve` reports: the printed tables, the search's answer, the progress bar."""

from __future__ import annotations

import asyncio
import io

from pdserve_bench.serve.metrics import Slo
from pdserve_bench.serve.mixes import SHORT_ONLY
from pdserve_bench.serve.progress import ProgressBar
from pdserve_bench.serve.report import format_report
from pdserve_bench.serve.runner import Counters
from pdserve_bench.serve.sweep import SearchSpec, run_all
from pdserve_bench.serve.workload import Load

from .fakes import FakeTarget


def test_table_rows_search_answers_and_side_by_side() -> None:
    good, bad = FakeTarget("good"), FakeTarget("bad", lambda r: 0.5 if (r or 0) > 150 else 1.0)
    load = Load(1000, mix=SHORT_ONLY, num_requests=10)
    search = SearchSpec(100.0, 200.0, 200.0, 0.9)
    result = asyncio.run(
        run_all([good, bad], load, rates=[100.0, 200.0], search=search, slo=Slo(),
                request_timeout_s=30.0)
    )  # fmt: skip
    text = format_report(result, [good, bad], slo=Slo(), headline="HEAD")
    lines = text.splitlines()
    assert lines[0] == "HEAD" and "TTFT <= 3 s" in lines[1] and "150 ms" in lines[1]
    rows = [ln for ln in lines if ln.startswith("| 200 ")]
    assert len(rows) == 3  # each target's table, and the side-by-side one
    bad_row = [c.strip() for c in rows[1].strip("|").split("|")]
    assert bad_row[1:7] == ["10", "5", "5 (50%)", "0 (0%)", "0", "0.50"]
    assert "highest rate with goodput >= 0.9: at least 200 req/s" in text
    assert "highest rate with goodput >= 0.9: 100 req/s (missed at 200)" in text
    assert "side by side:" in text


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_in_place_only_on_a_terminal() -> None:
    out = Tty()
    bar = ProgressBar(out)
    bar.update("a", 4.0, Counters(total=10, sent=3, finished=1, ok=1))
    bar.update("a", 4.0, Counters(total=10, sent=10, finished=10, ok=9, rejected=1))
    bar.update("b", None, Counters(total=2, sent=1))
    bar.done()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n")
    assert "a @ 4 req/s [" in text and "10/10 done, 0 in flight, 1 rejected" in text
    assert "\n\rb [" in text  # the finished point's line is kept
    quiet = Tty()
    ProgressBar(quiet, enabled=False).update("a", 1.0, Counters(total=1))
    piped = io.StringIO()
    ProgressBar(piped).update("a", 1.0, Counters(total=1))
    assert quiet.getvalue() == piped.getvalue() == ""
