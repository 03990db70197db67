"""The control-plane benchmark's reading of traces: what scheduling adds to each request."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.telemetry.record import SpanRecord
from pdserve.telemetry.spans import ATTR_REQUEST_ID
from pdserve_bench.control_plane import Throughput, scheduling_ms


def span(trace: str, sid: str, name: str, start_ms: float, end_ms: float, **attrs: str) -> str:
    record = SpanRecord(
        trace, sid, None if name == "router.request" else "r" + trace, name, "svc",
        int(start_ms * 1e6), int(end_ms * 1e6), dict(attrs),
    )  # fmt: skip
    return json.dumps(record.to_json())


def test_scheduling_is_the_router_part_plus_the_placement(tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    lines = [
        span("a", "ra", "router.request", 0, 100, **{ATTR_REQUEST_ID: "x-0"}),
        span("a", "m", "router.mode_decision", 0, 1.5),
        span("a", "s", "scheduler.assign", 1.5, 4.0),
        span("a", "p", "prefill.compute", 4.0, 50),  # not scheduling
        span("b", "rb", "router.request", 0, 100, **{ATTR_REQUEST_ID: "x-1"}),
        span("b", "m2", "router.mode_decision", 0, 1.0),
        # A re-placement after a failure: both assigns count.
        span("b", "s2", "scheduler.assign", 1.0, 2.0),
        span("b", "s3", "scheduler.assign", 30.0, 31.0),
        span("c", "rc", "router.request", 0, 100, **{ATTR_REQUEST_ID: "other-0"}),
        span("c", "m3", "router.mode_decision", 0, 9.0),
        span("c", "s4", "scheduler.assign", 9.0, 19.0),
    ]
    spans.write_text("\n".join(lines) + "\n")
    got = scheduling_ms(spans, ["x-0", "x-1"], wait_s=0.0)
    assert sorted(got) == [3.0, 4.0]


def test_a_request_without_its_placement_span_is_left_out(tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    spans.write_text(
        "\n".join(
            [
                span("a", "ra", "router.request", 0, 10, **{ATTR_REQUEST_ID: "x-0"}),
                span("a", "m", "router.mode_decision", 0, 1.0),
            ]
        )
        + "\n"
    )
    assert scheduling_ms(spans, ["x-0"], wait_s=0.0) == []


def test_tokens_per_core_second() -> None:
    assert Throughput(32, "router", 10_000, 2.0).per_core_s == 5000.0
    assert Throughput(32, "router", 10, 0.0).per_core_s == 0.0
