"""The ``PDSERVE_SPAN_FILE`` exporter: finished spans as JSON lines, and the reader.

Several processes (the five services of a local cluster) may append to the same file. The
file is opened with ``O_APPEND`` and every export writes its whole batch of complete lines
with one ``write`` call: the kernel positions each append atomically at the end of the file,
so lines from different processes never interleave inside one another. The exporter runs
behind a ``BatchSpanProcessor``, so the writes happen on the processor's thread, not in the
event loop that ended the span.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import format_span_id, format_trace_id

from pdserve.errors import InvalidArgumentError
from pdserve.telemetry.record import AttributeValue, SpanEvent, SpanRecord

logger = logging.getLogger(__name__)


def _attributes(raw: object) -> dict[str, AttributeValue]:
    if raw is None:
        return {}
    items = raw.items() if hasattr(raw, "items") else ()
    # OpenTelemetry stores sequence attributes as tuples; JSON wants lists.
    return {str(k): list(v) if isinstance(v, tuple) else v for k, v in items}


def record_from_span(span: ReadableSpan) -> SpanRecord:
    """The ``SpanRecord`` of a finished SDK span (start and end times must be set)."""
    ctx = span.context
    if ctx is None or span.start_time is None or span.end_time is None:
        raise InvalidArgumentError("span", f"{span.name!r} is not a finished, valid span")
    service = span.resource.attributes.get("service.name", "")
    return SpanRecord(
        trace_id=format_trace_id(ctx.trace_id),
        span_id=format_span_id(ctx.span_id),
        parent_id=format_span_id(span.parent.span_id) if span.parent is not None else None,
        name=span.name,
        service=str(service),
        start_ns=span.start_time,
        end_ns=span.end_time,
        attributes=_attributes(span.attributes),
        events=tuple(
            SpanEvent(e.name, e.timestamp, _attributes(e.attributes)) for e in span.events
        ),
        kind=span.kind.name,
        status=span.status.status_code.name,
    )


class JsonLinesSpanExporter(SpanExporter):
    """Appends each exported span to ``path`` as one JSON line (``SpanRecord.to_json``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # export() runs on the batch thread, shutdown() on whichever thread shuts tracing down.
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(
            json.dumps(record_from_span(s).to_json(), separators=(",", ":")) + "\n" for s in spans
        ).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                view = memoryview(data)
                while view:  # a short write happens only on a full disk or a signal
                    view = view[os.write(self._fd, view) :]
            except OSError as err:
                logger.error("cannot append %d spans to %s: %s", len(spans), self.path, err)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True  # os.write is unbuffered: every exported line is already in the file

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_span_file(path: str | os.PathLike[str]) -> list[SpanRecord]:
    """Every span in a span file; a malformed line raises naming its line number."""
    records: list[SpanRecord] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise InvalidArgumentError(where, f"not JSON: {err}") from err
            records.append(SpanRecord.from_json(obj, where=where))
    return records
