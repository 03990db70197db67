"""The per-process telemetry wiring: metrics flags, the /metrics endpoint and its port file,
and the summary ``pdserve up`` prints."""

from __future__ import annotations

import argparse
import urllib.request
from pathlib import Path

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve.telemetry.metrics import SchedulerMetrics
from pdserve.telemetry.service import (
    MetricsEndpoint,
    ServiceTelemetry,
    add_telemetry_args,
    describe_telemetry,
)


@pytest.fixture(autouse=True)
def _no_tracing_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tracing stays off here whatever the developer's environment says (it is global)."""
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "PDSERVE_SPAN_FILE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


def _parse(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_telemetry_args(parser, env)
    return parser.parse_args(argv)


def test_flags_default_to_the_environment_then_a_free_port() -> None:
    assert _parse([], {}).metrics_port == 0
    assert _parse([], {"PDSERVE_METRICS_PORT": "9100"}).metrics_port == 9100
    args = _parse(["--metrics-port", "-1", "--metrics-port-file", "m.port"], {})
    assert MetricsEndpoint.from_args(args) == MetricsEndpoint(-1, Path("m.port"))
    with pytest.raises(InvalidArgumentError, match="PDSERVE_METRICS_PORT"):
        _parse([], {"PDSERVE_METRICS_PORT": "ninety"})
    with pytest.raises(InvalidArgumentError, match="--metrics-port"):
        MetricsEndpoint(70000)


def test_start_serves_metrics_and_writes_the_bound_port(tmp_path: Path) -> None:
    metrics = SchedulerMetrics(process=False)
    metrics.count_decision("least_loaded", "assigned")
    port_file = tmp_path / "scheduler.metrics-port"
    telemetry = ServiceTelemetry.start(
        "pdserve-scheduler", metrics.registry, endpoint=MetricsEndpoint(0, port_file)
    )
    try:
        assert telemetry.tracer_provider is None  # nothing configured: no tracing
        assert telemetry.server_interceptors() == []
        assert telemetry.metrics_server is not None
        port = int(port_file.read_text())
        assert port == telemetry.metrics_server.port > 0
        assert telemetry.metrics_url == f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(telemetry.metrics_url, timeout=10) as resp:
            body = resp.read().decode()
        assert (
            'pdserve_scheduler_decisions_total{outcome="assigned",policy="least_loaded"} 1.0'
            in body
        )
    finally:
        telemetry.close()
    telemetry.close()  # idempotent
    assert telemetry.metrics_url is None


def test_a_negative_port_serves_no_metrics(tmp_path: Path) -> None:
    telemetry = ServiceTelemetry.start(
        "pdserve-router",
        SchedulerMetrics(process=False).registry,
        endpoint=MetricsEndpoint(-1, tmp_path / "none"),
    )
    assert telemetry.metrics_server is None and not (tmp_path / "none").exists()
    telemetry.close()


def test_summary_names_every_endpoint_and_where_traces_go() -> None:
    urls = {"router": "http://127.0.0.1:9100/metrics", "kvstore": "http://127.0.0.1:9101/metrics"}
    off = describe_telemetry(urls, {})
    assert all(url in off for url in urls.values())
    assert "traces: off" in off and "--otlp-endpoint" in off
    assert "OTEL_SDK_DISABLED" in describe_telemetry(
        urls, {"OTEL_SDK_DISABLED": "true", "PDSERVE_SPAN_FILE": "/tmp/s.jsonl"}
    )
    on = describe_telemetry(
        urls,
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317", "PDSERVE_SPAN_FILE": "/tmp/s.jsonl"},
    )
    assert "OTLP to http://jaeger:4317" in on
    assert "pdserve trace report --span-file /tmp/s.jsonl" in on
