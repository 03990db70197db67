"""Synthetic pdserve traces with known stage durations, in span-file and Jaeger formats.

Built by hand from the documented formats (not through the code under test), so that the
report's numbers can be checked against durations this module chose. Times are whole
microseconds, so the Jaeger form (microsecond resolution) carries exactly the same values.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

US = 1000  # ns
BASE_NS = 1_700_000_000_000_000_000  # an epoch time in 2023, a multiple of 1 us

# Span names as documented in docs/observability.md, in path order.
ROOT = "router.request"
STAGE_NAMES = (
    "router.mode_decision",
    "scheduler.assign",
    "prefill.queue",
    "prefill.compute",
    "kv.transfer.send",
    "kv.transfer.recv",
    "decode.queue",
    "decode.first_token",
    "decode.generate",
)

SERVICE_OF = {
    "router.mode_decision": "pdserve-router",
    "scheduler.assign": "pdserve-scheduler",
    "prefill.queue": "pdserve-prefill",
    "prefill.compute": "pdserve-prefill",
    "kv.transfer.send": "pdserve-prefill",
    "kv.transfer.recv": "pdserve-decode",
    "decode.queue": "pdserve-decode",
    "decode.first_token": "pdserve-decode",
    "decode.generate": "pdserve-decode",
}


@dataclass
class SyntheticTraces:
    """Span-file lines (dicts), plus the durations each request was given (ns)."""

    lines: list[dict[str, Any]] = field(default_factory=list)
    e2e_ns: list[int] = field(default_factory=list)
    stage_ns: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    request_ids: list[str] = field(default_factory=list)


def _hex(rng: random.Random, digits: int) -> str:
    return f"{rng.getrandbits(digits * 4) | 1:0{digits}x}"


def make_traces(n_requests: int, seed: int = 7) -> SyntheticTraces:
    """``n_requests`` traces; every third one is colocated (no KV transfer stages).

    Also adds gRPC spans that are not stages (must be ignored) and one trace without a
    ``router.request`` span (must be counted as skipped).
    """
    rng = random.Random(seed)
    out = SyntheticTraces()

    def span(
        trace: str, parent: str | None, name: str, service: str, start: int, dur: int, **attrs: Any
    ) -> str:
        sid = _hex(rng, 16)
        out.lines.append(
            {
                "trace_id": trace,
                "span_id": sid,
                "parent_id": parent,
                "name": name,
                "service": service,
                "kind": "INTERNAL",
                "status": "UNSET",
                "start_ns": start,
                "end_ns": start + dur,
                "attributes": attrs,
                "events": [],
            }
        )
        return sid

    for i in range(n_requests):
        trace = _hex(rng, 32)
        colocated = i % 3 == 2
        t0 = BASE_NS + i * 50_000 * US
        us = {name: rng.randint(50, 5000) * US for name in STAGE_NAMES}
        if colocated:
            del us["kv.transfer.send"], us["kv.transfer.recv"]
        # Sequential path; the receive starts halfway through the send (they overlap).
        t = t0 + 20 * US
        starts: dict[str, int] = {}
        for name in STAGE_NAMES:
            if name not in us:
                continue
            if name == "kv.transfer.recv":
                t = starts["kv.transfer.send"] + us["kv.transfer.send"] // (2 * US) * US
            starts[name] = t
            t += us[name] + 10 * US
        e2e = max(starts[n] + us[n] for n in us) + 30 * US - t0
        request_id = f"req-{i:04d}"
        root = span(
            trace, None, ROOT, "pdserve-router", t0, e2e, **{"pdserve.request_id": request_id}
        )
        out.request_ids.append(request_id)
        out.e2e_ns.append(e2e)
        # A gRPC client/server span pair between router and each worker, as the interceptors
        # make them; stage spans hang below the server span.
        for name in us:
            service = SERVICE_OF[name]
            parent = root
            if service != "pdserve-router":
                parent = span(
                    trace, root, f"/pdserve.v1.Rpc/{name}", service,
                    starts[name] - 5 * US, us[name] + 8 * US,
                )  # fmt: skip
            span(trace, parent, name, service, starts[name], us[name])
            out.stage_ns[name].append(us[name])
    orphan = _hex(rng, 32)
    span(orphan, None, "/grpc.health.v1.Health/Check", "pdserve-prefill", BASE_NS, 100 * US)
    span(orphan, None, "prefill.compute", "pdserve-prefill", BASE_NS, 90 * US)
    return out


def to_jaeger(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The same spans as a Jaeger ``/api/traces`` response (microsecond times, typed tags)."""
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    services: dict[str, dict[str, str]] = defaultdict(dict)
    for line in lines:
        trace = line["trace_id"]
        pids = services[trace]
        pid = pids.setdefault(line["service"], f"p{len(pids) + 1}")
        tags = [
            {"key": k, "type": "int64" if isinstance(v, int) else "string", "value": v}
            for k, v in line["attributes"].items()
        ]
        tags.append({"key": "span.kind", "type": "string", "value": "internal"})
        refs = (
            [{"refType": "CHILD_OF", "traceID": trace, "spanID": line["parent_id"]}]
            if line["parent_id"]
            else []
        )
        traces[trace].append(
            {
                "traceID": trace,
                "spanID": line["span_id"],
                "operationName": line["name"],
                "references": refs,
                "startTime": line["start_ns"] // US,
                "duration": (line["end_ns"] - line["start_ns"]) // US,
                "tags": tags,
                "logs": [],
                "processID": pid,
                "warnings": None,
            }
        )
    data = [
        {
            "traceID": trace,
            "spans": spans,
            "processes": {
                pid: {"serviceName": svc, "tags": []} for svc, pid in services[trace].items()
            },
            "warnings": None,
        }
        for trace, spans in traces.items()
    ]
    return {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None}
