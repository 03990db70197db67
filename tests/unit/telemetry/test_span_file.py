"""The JSON-lines span file: the record format, the exporter, several writers, the reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.errors import InvalidArgumentError
from pdserve.telemetry.record import SpanRecord
from pdserve.telemetry.span_file import JsonLinesSpanExporter, read_span_file, record_from_span
from pdserve.telemetry.tracing import record_span


def test_a_finished_span_becomes_a_record_and_back(
    provider: TracerProvider, memory_exporter: InMemorySpanExporter
) -> None:
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("router.request") as root:
        span = record_span(
            "kv.transfer.send", 1_000, 5_000, {"pdserve.bytes": 4096, "dims": (1, 2)},
            tracer_provider=provider,
        )  # fmt: skip
        root.add_event("first_token", {"pdserve.tokens": 1}, timestamp=2_000)
    finished = {s.name: s for s in memory_exporter.get_finished_spans()}
    child = record_from_span(finished["kv.transfer.send"])
    parent = record_from_span(finished["router.request"])
    assert child.trace_id == f"{span.get_span_context().trace_id:032x}"
    assert child.span_id == f"{span.get_span_context().span_id:016x}"
    assert child.parent_id == parent.span_id and parent.parent_id is None
    assert (child.start_ns, child.end_ns, child.duration_ns) == (1_000, 5_000, 4_000)
    assert child.attributes == {"pdserve.bytes": 4096, "dims": [1, 2]}
    assert child.service == "unit-test" and child.kind == "INTERNAL"
    assert [(e.name, e.time_ns, e.attributes) for e in parent.events] == [
        ("first_token", 2_000, {"pdserve.tokens": 1})
    ]
    for record in (child, parent):
        line = json.dumps(record.to_json())
        assert SpanRecord.from_json(json.loads(line)) == record


def test_the_exporter_appends_lines_that_read_back(
    tmp_path: Path, provider: TracerProvider, memory_exporter: InMemorySpanExporter
) -> None:
    path = tmp_path / "nested" / "spans.jsonl"
    path.parent.mkdir()
    path.write_text("")  # appending to an existing file keeps what is there
    file_exporter = JsonLinesSpanExporter(path)
    provider.add_span_processor(BatchSpanProcessor(file_exporter))
    tracer = provider.get_tracer("t")
    for i in range(25):
        with tracer.start_as_current_span(f"span-{i}"):
            pass
    provider.force_flush()
    expected = [record_from_span(s) for s in memory_exporter.get_finished_spans()]
    assert read_span_file(path) == expected


_WRITER = """
import sys
from pdserve.telemetry import tracing
tracing.init_tracing("unused")
padding = "x" * 3000  # long lines: interleaved writes would be caught by the JSON parser
for i in range(int(sys.argv[1])):
    tracing.record_span(f"stage-{i}", i, i + 1, {"pad": padding, "i": i})
tracing.shutdown_tracing()
"""


def test_several_processes_append_whole_lines_to_one_file(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    per_process, writers = 400, 4
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PDSERVE_"))}
    procs = []
    for w in range(writers):
        env = base | {
            "PDSERVE_SPAN_FILE": str(path),
            "OTEL_SERVICE_NAME": f"writer-{w}",
            # Small batches: many separate appends from each process, racing each other.
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "7",
            "OTEL_BSP_SCHEDULE_DELAY": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _WRITER, str(per_process)],
                env=env,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    lines = path.read_text().splitlines()
    records = [SpanRecord.from_json(json.loads(line)) for line in lines]
    assert Counter(r.service for r in records) == {
        f"writer-{w}": per_process for w in range(writers)
    }
    assert len({(r.trace_id, r.span_id) for r in records}) == per_process * writers
    for w in range(writers):
        mine = [r for r in records if r.service == f"writer-{w}"]
        indices = [r.attributes["i"] for r in mine]
        assert sorted(i for i in indices if isinstance(i, int)) == list(range(per_process))


def test_a_malformed_line_is_reported_with_its_line_number(tmp_path: Path) -> None:
    good = {
        "trace_id": "ab" * 16,
        "span_id": "cd" * 8,
        "parent_id": None,
        "name": "router.request",
        "start_ns": 5,
        "end_ns": 9,
    }
    path = tmp_path / "spans.jsonl"
    path.write_text(json.dumps(good) + "\n\n{not json\n")
    with pytest.raises(InvalidArgumentError) as err:
        read_span_file(path)
    assert err.value.field == f"{path}:3"
    path.write_text(json.dumps(good) + "\n" + json.dumps(good | {"end_ns": "soon"}) + "\n")
    with pytest.raises(InvalidArgumentError) as err:
        read_span_file(path)
    assert err.value.field == f"{path}:2.end_ns"
    path.write_text(json.dumps(good) + "\n")
    (record,) = read_span_file(path)
    assert (record.name, record.duration_ns, record.service, record.events) == (
        "router.request",
        4,
        "",
        (),
    )
