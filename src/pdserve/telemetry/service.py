"""The telemetry of one service process: tracing set-up, the ``/metrics`` endpoint, shut-down.

Every service ``__main__`` does the same thing, so it lives here once::

    add_telemetry_args(parser, os.environ)                     # --metrics-port, --metrics-port-file
    args = parser.parse_args()
    metrics = RouterMetrics()
    telemetry = ServiceTelemetry.start(
        SERVICE_ROUTER, metrics.registry, host=args.host, endpoint=MetricsEndpoint.from_args(args)
    )
    try:
        server, port, health = build_server(..., interceptors=telemetry.server_interceptors())
        ...
    finally:
        telemetry.close()                                      # flushes queued spans

``start`` installs tracing from the ``OTEL_*`` environment (``tracing.init_tracing``) before
any server or channel exists, so that the interceptors and every client channel see the
provider. ``--metrics-port 0`` binds a free port; the bound one is written to
``--metrics-port-file`` (write-then-rename, like the gRPC ``--port-file``) before the service
reports its gRPC port, so a launcher that waits for the gRPC port file can read both.
A negative port serves no ``/metrics`` at all.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from pdserve.errors import InvalidArgumentError
from pdserve.rpc.server import write_port_file
from pdserve.telemetry import tracing
from pdserve.telemetry.handover import StageEndInterceptor
from pdserve.telemetry.metrics_http import MetricsServer, start_metrics_server
from pdserve.telemetry.spans import SERVICE_ROUTER

logger = logging.getLogger(__name__)

ENV_METRICS_PORT = "PDSERVE_METRICS_PORT"
"""Default of ``--metrics-port``."""


def add_telemetry_args(
    parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None
) -> None:
    """Add ``--metrics-port`` (default ``$PDSERVE_METRICS_PORT``, else 0) and
    ``--metrics-port-file`` to a service's flags."""
    environ = os.environ if env is None else env
    raw = environ.get(ENV_METRICS_PORT, "0")
    try:
        default_port = int(raw)
    except ValueError:
        raise InvalidArgumentError(ENV_METRICS_PORT, f"must be an integer, got {raw!r}") from None
    group = parser.add_argument_group("telemetry (tracing is configured by OTEL_* variables)")
    group.add_argument(
        "--metrics-port", type=int, default=default_port,
        help="Prometheus /metrics port on --host; 0 picks a free port, -1 serves none",
    )  # fmt: skip
    group.add_argument(
        "--metrics-port-file", type=Path, help="write the bound metrics port here once serving"
    )


@dataclass(frozen=True, slots=True)
class MetricsEndpoint:
    """Where to serve ``/metrics``: ``port`` (0: a free one, negative: nowhere) and the file
    that receives the bound port."""

    port: int = 0
    port_file: Path | None = None

    def __post_init__(self) -> None:
        if self.port > 65535:
            raise InvalidArgumentError("--metrics-port", f"must be <= 65535, got {self.port}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MetricsEndpoint:
        """From the flags ``add_telemetry_args`` added."""
        return cls(args.metrics_port, args.metrics_port_file)


@dataclass(slots=True)
class ServiceTelemetry:
    """The tracer provider (None when tracing is off) and ``/metrics`` server of a process."""

    service_name: str
    tracer_provider: TracerProvider | None
    metrics_server: MetricsServer | None

    @classmethod
    def start(
        cls,
        service_name: str,
        registry: CollectorRegistry,
        *,
        host: str = "127.0.0.1",
        endpoint: MetricsEndpoint | None = None,
    ) -> ServiceTelemetry:
        """Install tracing from the environment and serve ``registry`` (see module docstring)."""
        endpoint = endpoint or MetricsEndpoint()
        provider = tracing.init_tracing(service_name)
        server: MetricsServer | None = None
        try:
            if endpoint.port >= 0:
                server = start_metrics_server(registry, endpoint.port, host)
                if endpoint.port_file is not None:
                    write_port_file(endpoint.port_file, server.port)
        except BaseException:
            if server is not None:
                server.close()
            tracing.shutdown_tracing(provider)
            raise
        return cls(service_name, provider, server)

    @property
    def metrics_url(self) -> str | None:
        return None if self.metrics_server is None else self.metrics_server.url

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """For ``build_server(interceptors=...)``: a SERVER span per call, and each call's
        stage end returned to its caller (``handover``); [] when untraced."""
        traced = tracing.server_interceptors(self.tracer_provider)
        return [*traced, StageEndInterceptor()] if traced else []

    def client_interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """For a channel to another service: CLIENT spans, ``traceparent`` sent along."""
        return tracing.client_interceptors(self.tracer_provider)

    def close(self) -> None:
        """Stop serving metrics, then export every span still queued."""
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        tracing.shutdown_tracing(self.tracer_provider)


def describe_telemetry(
    metrics_urls: Mapping[str, str], env: Mapping[str, str], log_dir: Path | None = None
) -> str:
    """Where a deployment's metrics and traces go, for people to read: the ``/metrics`` URL of
    each service, and the trace exporters its environment ``env`` configures."""
    lines = ["metrics (Prometheus; dashboard: deploy/grafana/pdserve-dashboard.json):"]
    lines += [f"  {name:<10} {url}" for name, url in metrics_urls.items()]
    config = tracing.TracingConfig.from_env(SERVICE_ROUTER, env)
    if not config.enabled:
        reason = "OTEL_SDK_DISABLED=true" if config.disabled else "no exporter configured"
        lines.append(f"traces: off ({reason}); use --otlp-endpoint URL or --trace-file PATH")
        return "\n".join(lines)
    lines.append("traces (one per request, rooted at router.request):")
    if "otlp" in config.exporters:
        endpoint = env.get(tracing.ENV_OTLP_TRACES_ENDPOINT) or env.get(tracing.ENV_OTLP_ENDPOINT)
        lines.append(f"  OTLP to {endpoint}; breakdown: pdserve trace report --jaeger URL")
    if "console" in config.exporters:
        lines.append(f"  printed to each service's log in {log_dir or 'its output'}")
    if config.span_file is not None:
        lines.append(
            f"  span file {config.span_file}; breakdown: pdserve trace report "
            f"--span-file {config.span_file} --out report/"
        )
    return "\n".join(lines)
