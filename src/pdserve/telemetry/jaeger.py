"""Load traces from a Jaeger query service's HTTP API (``GET /api/traces``).

The response is ``{"data": [trace, ...], "errors": null | [...]}``; a trace is
``{"traceID", "spans": [...], "processes": {"p1": {"serviceName", "tags"}}}``; a span has
``spanID``, ``operationName``, ``references`` (``CHILD_OF`` gives the parent), ``startTime``
and ``duration`` in microseconds, ``tags`` (``[{"key", "type", "value"}]``), ``logs``
(``[{"timestamp", "fields"}]``) and ``processID``. Jaeger prints a 128-bit trace id whose
high half is zero as 16 hex digits; ids are zero-padded back to the W3C widths here.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.errors import InvalidArgumentError, WorkerUnavailableError
from pdserve.telemetry.record import AttributeValue, SpanEvent, SpanRecord

_US = 1000  # ns per microsecond


def _tags(raw: object) -> dict[str, AttributeValue]:
    if not isinstance(raw, Sequence):
        return {}
    return {str(t["key"]): t.get("value", "") for t in raw if isinstance(t, Mapping) and "key" in t}


def _parent(span: Mapping[str, Any]) -> str | None:
    refs = [r for r in span.get("references") or [] if isinstance(r, Mapping)]
    child_of = [r for r in refs if r.get("refType") == "CHILD_OF"] or refs
    return str(child_of[0]["spanID"]).zfill(16) if child_of else None


def _span(
    span: Mapping[str, Any], trace_id: str, services: Mapping[str, str], where: str
) -> SpanRecord:
    try:
        start_ns = int(span["startTime"]) * _US
        end_ns = start_ns + int(span["duration"]) * _US
        span_id = str(span["spanID"]).zfill(16)
        name = str(span["operationName"])
    except (KeyError, TypeError, ValueError) as err:
        raise InvalidArgumentError(where, f"not a Jaeger span: {err!r}") from err
    tags = _tags(span.get("tags"))
    # The OpenTelemetry-to-Jaeger mapping moves kind and status into tags.
    kind = str(tags.pop("span.kind", "internal")).upper()
    status = str(tags.pop("otel.status_code", "UNSET")).upper()
    events = tuple(
        SpanEvent(
            name=str(_tags(log.get("fields")).pop("event", "log")),
            time_ns=int(log.get("timestamp", 0)) * _US,
            attributes={k: v for k, v in _tags(log.get("fields")).items() if k != "event"},
        )
        for log in span.get("logs") or []
        if isinstance(log, Mapping)
    )
    return SpanRecord(
        trace_id=trace_id,
        span_id=span_id,
        parent_id=_parent(span),
        name=name,
        service=services.get(str(span.get("processID", "")), ""),
        start_ns=start_ns,
        end_ns=end_ns,
        attributes=tags,
        events=events,
        kind=kind,
        status=status,
    )


def parse_jaeger_traces(payload: object) -> list[SpanRecord]:
    """Every span of a ``/api/traces`` response (or a Jaeger UI "download JSON" file)."""
    if not isinstance(payload, Mapping) or not isinstance(payload.get("data"), Sequence):
        raise InvalidArgumentError("jaeger", "expected an object with a 'data' list of traces")
    records: list[SpanRecord] = []
    for i, trace in enumerate(payload["data"]):
        if not isinstance(trace, Mapping):
            raise InvalidArgumentError(f"jaeger.data[{i}]", "expected a trace object")
        processes = trace.get("processes") or {}
        services = {
            str(pid): str(p.get("serviceName", ""))
            for pid, p in processes.items()
            if isinstance(p, Mapping)
        }
        trace_id = str(trace.get("traceID", "")).zfill(32)
        for j, span in enumerate(trace.get("spans") or []):
            where = f"jaeger.data[{i}].spans[{j}]"
            if not isinstance(span, Mapping):
                raise InvalidArgumentError(where, "expected a span object")
            own_trace = str(span.get("traceID", trace_id)).zfill(32)
            records.append(_span(span, own_trace, services, where))
    return records


def fetch_jaeger_traces(
    url: str,
    *,
    service: str,
    limit: int,
    lookback_s: float = 3600.0,
) -> list[SpanRecord]:
    """Query ``url`` (the Jaeger query service, e.g. ``http://localhost:16686``) for the
    ``limit`` most recent traces through ``service`` within the last ``lookback_s`` seconds."""
    if limit < 1:
        raise InvalidArgumentError("limit", f"must be >= 1, got {limit}")
    if lookback_s <= 0:
        raise InvalidArgumentError("lookback_s", f"must be > 0, got {lookback_s}")
    end_us = time.time_ns() // _US
    query = urllib.parse.urlencode(
        {
            "service": service,
            "limit": limit,
            "start": end_us - round(lookback_s * 1e6),
            "end": end_us,
        }
    )
    address = f"{url.rstrip('/')}/api/traces?{query}"
    try:
        with urllib.request.urlopen(address, timeout=30.0) as resp:
            payload = json.load(resp)
    except urllib.error.HTTPError as err:
        raise WorkerUnavailableError(f"Jaeger query {address} failed: HTTP {err.code}") from err
    except (urllib.error.URLError, OSError) as err:
        raise WorkerUnavailableError(f"cannot reach Jaeger at {url}: {err}") from err
    except json.JSONDecodeError as err:
        raise InvalidArgumentError("jaeger", f"{address} did not return JSON: {err}") from err
    if isinstance(payload, Mapping) and payload.get("errors"):
        raise WorkerUnavailableError(f"Jaeger query {address} failed: {payload['errors']}")
    return parse_jaeger_traces(payload)
