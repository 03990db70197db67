"""``SpanRecord``: one finished span, independent of where it was exported to.

The span file (``PDSERVE_SPAN_FILE``) stores one ``SpanRecord.to_json()`` object per line, and
the Jaeger loader builds the same records, so the latency report has one input type. Ids are
lower-case hex as in W3C trace context (trace id 32 digits, span id 16); times are Unix epoch
nanoseconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import InvalidArgumentError

AttributeValue = str | bool | int | float | list[str] | list[bool] | list[int] | list[float]


@dataclass(frozen=True, slots=True)
class SpanEvent:
    """A timestamped annotation inside a span (``span.add_event``)."""

    name: str
    time_ns: int
    attributes: dict[str, AttributeValue] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """A finished span: identity, parentage, service, timing, attributes and events."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, AttributeValue] = field(default_factory=dict)
    events: tuple[SpanEvent, ...] = ()
    kind: str = "INTERNAL"
    status: str = "UNSET"

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def to_json(self) -> dict[str, Any]:
        """The JSON object of one span-file line."""
        return {
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_id": self.parent_id,
            "name": self.name,
            "service": self.service,
            "kind": self.kind,
            "status": self.status,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "attributes": self.attributes,
            "events": [
                {"name": e.name, "time_ns": e.time_ns, "attributes": e.attributes}
                for e in self.events
            ],
        }

    @classmethod
    def from_json(cls, obj: object, *, where: str = "span") -> SpanRecord:
        """Parse ``to_json()`` output; a malformed object raises naming ``where`` and the field."""
        if not isinstance(obj, Mapping):
            raise InvalidArgumentError(where, f"expected a JSON object, got {type(obj).__name__}")
        parent = obj.get("parent_id")
        if parent is not None and not isinstance(parent, str):
            raise InvalidArgumentError(f"{where}.parent_id", "must be a hex string or null")
        start_ns = _int(obj, "start_ns", where)
        end_ns = _int(obj, "end_ns", where)
        if end_ns < start_ns:
            raise InvalidArgumentError(f"{where}.end_ns", f"{end_ns} is before start {start_ns}")
        events_raw = obj.get("events", [])
        if not isinstance(events_raw, Sequence) or isinstance(events_raw, str):
            raise InvalidArgumentError(f"{where}.events", "must be a list")
        events = tuple(
            SpanEvent(
                name=_str(ev, "name", f"{where}.events[{i}]"),
                time_ns=_int(ev, "time_ns", f"{where}.events[{i}]"),
                attributes=_attrs(ev, f"{where}.events[{i}]"),
            )
            for i, ev in enumerate(events_raw)
        )
        return cls(
            trace_id=_str(obj, "trace_id", where),
            span_id=_str(obj, "span_id", where),
            parent_id=parent or None,
            name=_str(obj, "name", where),
            service=str(obj.get("service", "")),
            start_ns=start_ns,
            end_ns=end_ns,
            attributes=_attrs(obj, where),
            events=events,
            kind=str(obj.get("kind", "INTERNAL")),
            status=str(obj.get("status", "UNSET")),
        )


def _str(obj: object, key: str, where: str) -> str:
    value = obj.get(key) if isinstance(obj, Mapping) else None
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{where}.{key}", "missing or not a non-empty string")
    return value


def _int(obj: object, key: str, where: str) -> int:
    value = obj.get(key) if isinstance(obj, Mapping) else None
    # bool is an int subclass; a true/false timestamp is a corrupt line, not 1 ns.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgumentError(f"{where}.{key}", "missing or not an integer")
    return value


def _attrs(obj: object, where: str) -> dict[str, AttributeValue]:
    value = obj.get("attributes", {}) if isinstance(obj, Mapping) else None
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"{where}.attributes", "must be a JSON object")
    return {str(k): v for k, v in value.items()}
