"""``pdserve trace report``: where a request's latency goes, from Jaeger or a span file.

    pdserve trace report --span-file spans.jsonl --out report/
    pdserve trace report --jaeger http://localhost:16686 --service pdserve-router --limit 200

Prints per-stage p50/p90/p99, mean and share of end to end, and writes ``breakdown.png``
(waterfall of the first requests) and ``breakdown.html`` (one self-contained page) to
``--out``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from pdserve.errors import InvalidArgumentError
from pdserve.telemetry.breakdown import Breakdown, compute_breakdown
from pdserve.telemetry.completeness import Gap, describe, gaps
from pdserve.telemetry.record import SpanRecord
from pdserve.telemetry.spans import E2E_SPAN, SERVICE_ROUTER

PNG_NAME = "breakdown.png"
HTML_NAME = "breakdown.html"

_POLL_S = 0.5
TABLE_COLUMNS = ("stage", "n", "p50_ms", "p90_ms", "p99_ms", "mean_ms", "share")


def format_table(breakdown: Breakdown) -> str:
    """The stats as a fixed-width text table (ms with 3 decimals, share in percent)."""
    width = max(len("stage"), *(len(s.stage) for s in breakdown.stats))
    header = f"{'stage':<{width}} {'n':>6} " + " ".join(f"{c:>10}" for c in TABLE_COLUMNS[2:])
    lines = [header, "-" * len(header)]
    for s in breakdown.stats:
        values = (s.p50_ms, s.p90_ms, s.p99_ms, s.mean_ms)
        lines.append(
            f"{s.stage:<{width}} {s.count:>6} "
            + " ".join(f"{v:>10.3f}" for v in values)
            + f" {100.0 * s.share:>9.1f}%"
        )
    return "\n".join(lines)


def summary_lines(breakdown: Breakdown) -> list[str]:
    """What the table needs said alongside it: counts, skipped traces, unseen stages."""
    out = [f"{len(breakdown.requests)} requests ({E2E_SPAN} spans)"]
    if breakdown.skipped_traces:
        out.append(f"{breakdown.skipped_traces} trace(s) without {E2E_SPAN} skipped")
    if breakdown.missing_stages:
        out.append("stages not seen: " + ", ".join(breakdown.missing_stages))
    out.append("shares overlap (KV send/receive run concurrently); they need not sum to 100%")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve trace report",
        description="Per-stage latency breakdown of pdserve requests from their traces.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--jaeger", metavar="URL", help="Jaeger query service, e.g. http://host:16686")
    src.add_argument(
        "--span-file", type=Path, metavar="F", help="a PDSERVE_SPAN_FILE JSON-lines file"
    )
    p.add_argument("--service", default=SERVICE_ROUTER, help="Jaeger service to query traces of")
    p.add_argument("--limit", type=int, default=100, help="Jaeger: most recent N traces")
    p.add_argument("--lookback-s", type=float, default=3600.0, help="Jaeger: search window")
    p.add_argument("--out", type=Path, default=Path("trace-report"), help="output directory")
    p.add_argument("--png-rows", type=int, default=60, help="requests drawn in the PNG")
    p.add_argument("--html-rows", type=int, default=1000, help="requests listed in the HTML")
    p.add_argument(
        "--wait-s",
        type=float,
        default=10.0,
        help="wait up to this long for traces still arriving to be whole; those that are "
        "not by then are named and left out (default: %(default)s)",
    )
    return p


def load_whole(ns: argparse.Namespace) -> tuple[list[SpanRecord], str, list[Gap]]:
    """``load_spans`` again until every trace is whole (``completeness``) or ``--wait-s``
    passes: the spans without the requests still incomplete, the source, and those."""
    deadline = time.monotonic() + ns.wait_s
    while True:
        spans, source = load_spans(ns)
        found = gaps(spans)
        if not found or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)  # other processes' exporters: nothing here to wait on
    # A trace without its router.request stays in: compute_breakdown counts it as skipped
    # (a router that does not trace looks the same once the wait is over).
    partial = [g for g in found if E2E_SPAN not in g.missing]
    left_out = {g.trace_id for g in partial}
    return [s for s in spans if s.trace_id not in left_out], source, partial


def load_spans(ns: argparse.Namespace) -> tuple[list[SpanRecord], str]:
    """The spans the arguments point at, and a description of where they came from."""
    if ns.span_file is not None:
        from pdserve.telemetry.span_file import read_span_file

        if not ns.span_file.is_file():
            raise InvalidArgumentError("--span-file", f"{ns.span_file} is not a file")
        return read_span_file(ns.span_file), str(ns.span_file)
    from pdserve.telemetry.jaeger import fetch_jaeger_traces

    spans = fetch_jaeger_traces(
        ns.jaeger, service=ns.service, limit=ns.limit, lookback_s=ns.lookback_s
    )
    return spans, f"{ns.jaeger} (service {ns.service})"


def main_report(argv: Sequence[str]) -> int:
    """Entry of ``pdserve trace report``."""
    ns = _parser().parse_args(list(argv))
    for flag, value in (("--png-rows", ns.png_rows), ("--html-rows", ns.html_rows)):
        if value < 1:
            raise InvalidArgumentError(flag, f"must be >= 1, got {value}")
    if not ns.wait_s >= 0:
        raise InvalidArgumentError("--wait-s", f"must be >= 0, got {ns.wait_s}")
    spans, source, partial = load_whole(ns)
    breakdown = compute_breakdown(spans)
    if not breakdown.requests:
        raise InvalidArgumentError(
            "--jaeger" if ns.jaeger else "--span-file",
            f"no {E2E_SPAN} span among {len(spans)} spans from {source}",
        )
    # Imported only now: matplotlib is the slowest import of the command.
    from pdserve.telemetry.chart import write_breakdown_png
    from pdserve.telemetry.html_report import write_breakdown_html

    print(f"latency breakdown from {source}")
    if partial:
        print(describe(partial, ns.wait_s))
    for line in summary_lines(breakdown):
        print(line)
    print(format_table(breakdown))
    ns.out.mkdir(parents=True, exist_ok=True)
    png, html = ns.out / PNG_NAME, ns.out / HTML_NAME
    png_rows = write_breakdown_png(breakdown, png, max_rows=ns.png_rows)
    html_rows = write_breakdown_html(breakdown, html, source=source, max_rows=ns.html_rows)
    print(f"wrote {png} ({png_rows} requests) and {html} ({html_rows} requests)")
    return 0
