"""Tracing set-up from the environment, and the stage-span helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from opentelemetry import context, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pdserve.errors import InvalidArgumentError
from pdserve.telemetry.tracing import (
    TracingConfig,
    build_tracer_provider,
    perf_to_epoch_ns,
    record_span,
    stage_span,
)

# --- configuration -------------------------------------------------------------------------


def test_nothing_configured_means_no_exporter() -> None:
    config = TracingConfig.from_env("pdserve-router", {})
    assert config == TracingConfig("pdserve-router")
    assert not config.enabled
    assert build_tracer_provider(config) is None


def test_an_otlp_endpoint_alone_selects_the_otlp_exporter() -> None:
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        config = TracingConfig.from_env("svc", {var: "http://127.0.0.1:4317"})
        assert config.exporters == ("otlp",)
        assert config.enabled


def test_explicit_exporters_service_name_and_span_file() -> None:
    env = {
        "OTEL_TRACES_EXPORTER": " Console , otlp,console",
        "OTEL_SERVICE_NAME": "from-env",
        "PDSERVE_SPAN_FILE": "/tmp/x.jsonl",
    }
    config = TracingConfig.from_env("pdserve-decode", env)
    assert config.exporters == ("console", "otlp")
    assert config.service_name == "from-env"
    assert config.span_file == Path("/tmp/x.jsonl")


def test_none_exporter_and_sdk_disabled() -> None:
    assert not TracingConfig.from_env(
        "s", {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317"}
    ).enabled
    only_file = TracingConfig.from_env(
        "s", {"OTEL_TRACES_EXPORTER": "none", "PDSERVE_SPAN_FILE": "f"}
    )
    assert only_file.enabled and only_file.exporters == ()
    disabled = TracingConfig.from_env(
        "s", {"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp", "PDSERVE_SPAN_FILE": "f"}
    )
    assert disabled.disabled and not disabled.enabled
    assert build_tracer_provider(disabled) is None


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json",
            },
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        ),
    ],
)
def test_unsupported_settings_are_rejected_naming_the_variable(
    env: dict[str, str], field: str
) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        TracingConfig.from_env("s", env)
    assert err.value.field == field


def test_empty_service_name_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError):
        TracingConfig.from_env("", {})


# --- stage_span / record_span ----------------------------------------------------------------


def test_stage_spans_nest_and_carry_attributes(
    provider: TracerProvider, memory_exporter: InMemorySpanExporter
) -> None:
    backdated = time.time_ns() - 5_000_000
    with (
        stage_span(
            "router.request", {"pdserve.tenant": "a"}, backdated, tracer_provider=provider
        ) as outer,
        stage_span("scheduler.assign", tracer_provider=provider) as inner,
    ):
        inner.set_attribute("pdserve.retries", 2)
    spans = {s.name: s for s in memory_exporter.get_finished_spans()}
    root, child = spans["router.request"], spans["scheduler.assign"]
    assert root.parent is None
    assert child.parent is not None and child.parent.span_id == root.context.span_id
    assert child.context.trace_id == root.context.trace_id == outer.get_span_context().trace_id
    assert root.start_time == backdated
    assert root.attributes == {"pdserve.tenant": "a"}
    assert child.attributes == {"pdserve.retries": 2}
    assert child.start_time is not None and child.end_time is not None
    assert root.end_time is not None
    assert backdated <= child.start_time <= child.end_time <= root.end_time


def test_an_escaping_exception_marks_the_stage_span_as_error(
    provider: TracerProvider, memory_exporter: InMemorySpanExporter
) -> None:
    with pytest.raises(RuntimeError), stage_span("decode.generate", tracer_provider=provider):
        raise RuntimeError("boom")
    (span,) = memory_exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert [e.name for e in span.events] == ["exception"]


def test_record_span_uses_the_given_times_and_parent(
    provider: TracerProvider, memory_exporter: InMemorySpanExporter
) -> None:
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("servicer") as servicer:
        captured = context.get_current()
    # Recorded later, outside the servicer span, from timestamps taken elsewhere.
    t0 = 1_700_000_000_000_000_000
    queue = record_span("prefill.queue", t0, t0 + 3_000, None, captured, tracer_provider=provider)
    record_span(
        "prefill.compute",
        t0 + 3_000,
        t0 + 10_000,
        {"pdserve.batch_size": 4},
        trace.set_span_in_context(queue),
        tracer_provider=provider,
    )
    spans = {s.name: s for s in memory_exporter.get_finished_spans()}
    q, c = spans["prefill.queue"], spans["prefill.compute"]
    assert (q.start_time, q.end_time) == (t0, t0 + 3_000)
    assert (c.start_time, c.end_time) == (t0 + 3_000, t0 + 10_000)
    assert q.parent is not None and q.parent.span_id == servicer.get_span_context().span_id
    assert c.parent is not None and c.parent.span_id == q.context.span_id
    assert c.attributes == {"pdserve.batch_size": 4}


def test_record_span_rejects_an_end_before_its_start(provider: TracerProvider) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        record_span("decode.queue", 10, 9, tracer_provider=provider)
    assert err.value.field == "end_ns"


def test_perf_counter_stamps_convert_to_wall_clock() -> None:
    # Reading two clocks is not atomic: allow a millisecond of slack either way.
    slack_ns = 1_000_000
    before = time.time_ns()
    stamp = time.perf_counter()
    converted = perf_to_epoch_ns(stamp)
    after = time.time_ns()
    assert before - slack_ns <= converted <= after + slack_ns
    earlier = perf_to_epoch_ns(stamp - 2.5)
    assert earlier - converted == pytest.approx(-2_500_000_000, abs=slack_ns)


_NOOP_SCRIPT = """
import json, os
from opentelemetry import trace
from pdserve.telemetry import tracing
provider = tracing.init_tracing("pdserve-router")
with tracing.stage_span("router.request") as span:
    recording = span.is_recording()
recorded = tracing.record_span("prefill.queue", 1, 2)
print(json.dumps({
    "provider": provider is None,
    "recording": recording or recorded.is_recording(),
    "server": len(tracing.server_interceptors()),
    "client": len(tracing.client_interceptors()),
    "global": type(trace.get_tracer_provider()).__name__,
}))
tracing.shutdown_tracing()
"""


def test_unconfigured_tracing_installs_nothing_and_records_nothing() -> None:
    # A fresh interpreter: init_tracing installs process-wide state, which must not leak here.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PDSERVE_"))}
    out = subprocess.run(
        [sys.executable, "-c", _NOOP_SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "provider": True,
        "recording": False,
        "server": 0,
        "client": 0,
        "global": "ProxyTracerProvider",
    }


_CONFIGURED_SCRIPT = """
from pdserve.telemetry import tracing
provider = tracing.init_tracing("pdserve-prefill")
assert tracing.init_tracing("other") is provider  # a second call keeps the first provider
assert len(tracing.server_interceptors()) == 1 and len(tracing.client_interceptors()) == 4
with tracing.stage_span("prefill.compute", {"pdserve.tokens": 7}):
    pass
tracing.shutdown_tracing()
"""


def test_init_tracing_exports_to_console_and_span_file(tmp_path: Path) -> None:
    span_file = tmp_path / "spans.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PDSERVE_"))}
    env |= {
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_SERVICE_NAME": "renamed",
        "PDSERVE_SPAN_FILE": str(span_file),
    }
    out = subprocess.run(
        [sys.executable, "-c", _CONFIGURED_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["name"] == "prefill.compute"
    assert printed["attributes"] == {"pdserve.tokens": 7}
    assert printed["resource"]["attributes"]["service.name"] == "renamed"
    (line,) = span_file.read_text().splitlines()
    stored = json.loads(line)
    assert (stored["name"], stored["service"]) == ("prefill.compute", "renamed")
    assert stored["trace_id"] == printed["context"]["trace_id"].removeprefix("0x")
