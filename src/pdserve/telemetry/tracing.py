"""OpenTelemetry tracing for the services: set-up from the environment, gRPC interceptors, stages.

Configuration is the standard OpenTelemetry environment only, plus ``PDSERVE_SPAN_FILE``:

* ``OTEL_SDK_DISABLED=true`` turns everything off (the span file included).
* ``OTEL_TRACES_EXPORTER``: comma-separated ``otlp``, ``console``, ``none``. When unset, OTLP is
  used only if ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set,
  so that an unconfigured service never tries to reach a collector that is not there.
* The OTLP exporter is the gRPC one and reads its own variables (endpoint, headers, TLS,
  timeout, compression). An ``http://`` endpoint means plaintext.
* ``OTEL_SERVICE_NAME`` overrides the name the service passes; ``OTEL_RESOURCE_ATTRIBUTES``,
  ``OTEL_TRACES_SAMPLER`` and ``OTEL_BSP_*`` apply as the SDK defines them.
* ``PDSERVE_SPAN_FILE=/path.jsonl`` also appends every finished span to that file.

When nothing is configured ``init_tracing`` returns ``None`` and installs nothing: the
interceptor helpers return empty lists and ``stage_span`` / ``record_span`` return a
non-recording span after one type check, so untraced serving pays next to nothing.

Every helper takes an optional ``tracer_provider``; without it, the process-wide provider that
``init_tracing`` installed is used (tests pass their own provider instead).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.util.types import Attributes

from pdserve.errors import InvalidArgumentError
from pdserve.telemetry.span_file import JsonLinesSpanExporter

logger = logging.getLogger(__name__)

ENV_SDK_DISABLED = "OTEL_SDK_DISABLED"
ENV_TRACES_EXPORTER = "OTEL_TRACES_EXPORTER"
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_SPAN_FILE = "PDSERVE_SPAN_FILE"

EXPORTERS = ("otlp", "console")
"""The span exporters ``OTEL_TRACES_EXPORTER`` may name (besides ``none``)."""

_INSTRUMENTATION_NAME = "pdserve"

# Health probes and reflection are infrastructure chatter, not request work: one span per
# readiness probe would bury the request traces.
_UNTRACED_SERVICE_PREFIXES = ("grpc.health.", "grpc.reflection.")


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """What the environment asks for: the service name, the exporters, the span file."""

    service_name: str
    exporters: tuple[str, ...] = ()
    span_file: Path | None = None
    disabled: bool = False

    @property
    def enabled(self) -> bool:
        return not self.disabled and (bool(self.exporters) or self.span_file is not None)

    @classmethod
    def from_env(cls, service_name: str, environ: Mapping[str, str] | None = None) -> TracingConfig:
        """Parse the variables above from ``environ`` (default ``os.environ``)."""
        env = os.environ if environ is None else environ
        name = env.get(ENV_SERVICE_NAME, "").strip() or service_name
        if not name:
            raise InvalidArgumentError("service_name", "must be non-empty")
        disabled = env.get(ENV_SDK_DISABLED, "").strip().lower() == "true"
        raw = env.get(ENV_TRACES_EXPORTER)
        if raw is None:
            has_endpoint = bool(env.get(ENV_OTLP_ENDPOINT) or env.get(ENV_OTLP_TRACES_ENDPOINT))
            exporters: tuple[str, ...] = ("otlp",) if has_endpoint else ()
        else:
            names = [n.strip().lower() for n in raw.split(",") if n.strip()]
            unknown = sorted(set(names) - {*EXPORTERS, "none"})
            if unknown:
                raise InvalidArgumentError(
                    ENV_TRACES_EXPORTER,
                    f"unsupported exporter(s) {unknown}; use {', '.join(EXPORTERS)} or none",
                )
            exporters = tuple(dict.fromkeys(n for n in names if n != "none"))
        if "otlp" in exporters:
            key = (
                ENV_OTLP_TRACES_PROTOCOL if env.get(ENV_OTLP_TRACES_PROTOCOL) else ENV_OTLP_PROTOCOL
            )
            protocol = env.get(key, "grpc").strip().lower()
            if protocol != "grpc":
                raise InvalidArgumentError(
                    key, f"only the OTLP gRPC exporter is installed, got protocol {protocol!r}"
                )
        span_file = env.get(ENV_SPAN_FILE, "").strip()
        return cls(
            service_name=name,
            exporters=exporters,
            span_file=Path(span_file) if span_file else None,
            disabled=disabled,
        )


def _exporter(name: str) -> SpanExporter:
    if name == "otlp":
        # Imported here: the gRPC exporter pulls in the OTLP protobufs, unneeded otherwise.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if name == "console":
        return ConsoleSpanExporter()
    raise InvalidArgumentError(ENV_TRACES_EXPORTER, f"unsupported exporter {name!r}")


def build_tracer_provider(config: TracingConfig) -> TracerProvider | None:
    """A provider exporting as ``config`` says (each exporter behind a batch processor).

    Returns ``None`` when ``config`` enables nothing. Does not install the provider globally.
    """
    if not config.enabled:
        return None
    # Resource.create also merges OTEL_RESOURCE_ATTRIBUTES; the explicit name wins over it.
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: config.service_name}))
    exporters = [_exporter(name) for name in config.exporters]
    if config.span_file is not None:
        exporters.append(JsonLinesSpanExporter(config.span_file))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _installed_provider() -> trace.TracerProvider | None:
    """The process-wide provider, or ``None`` while only the API's no-op default is there."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return provider


def init_tracing(service_name: str) -> TracerProvider | None:
    """Configure tracing for this process from the environment; call once, at start-up.

    Installs the provider process-wide (the gRPC interceptors and stage helpers find it there)
    and returns it, or returns ``None`` when the environment enables no exporter. A second
    call returns the provider the first one installed.
    """
    existing = _installed_provider()
    if isinstance(existing, TracerProvider):
        return existing
    config = TracingConfig.from_env(service_name)
    provider = build_tracer_provider(config)
    if provider is None:
        return None
    trace.set_tracer_provider(provider)
    logger.info(
        "tracing %s: exporters %s, span file %s",
        config.service_name, ",".join(config.exporters) or "-", config.span_file or "-",
    )  # fmt: skip
    return provider


def shutdown_tracing(tracer_provider: TracerProvider | None = None) -> None:
    """Export every span still queued and stop the exporters (no-op when tracing is off)."""
    provider = tracer_provider if tracer_provider is not None else _installed_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def _traced_provider(tracer_provider: trace.TracerProvider | None) -> trace.TracerProvider | None:
    return tracer_provider if tracer_provider is not None else _installed_provider()


def _call_filter() -> Callable[[object], bool]:
    from opentelemetry.instrumentation.grpc.filters import any_of, negate, service_prefix

    return negate(any_of(*(service_prefix(p) for p in _UNTRACED_SERVICE_PREFIXES)))


def server_interceptors(
    tracer_provider: trace.TracerProvider | None = None,
) -> list[grpc.aio.ServerInterceptor]:
    """Interceptors for ``grpc.aio.server(interceptors=...)``: one SERVER span per call.

    The span continues the caller's trace from the W3C ``traceparent`` metadata. Streaming
    handlers must be async generators (the span ends when the stream does). Empty when
    tracing is off.
    """
    provider = _traced_provider(tracer_provider)
    if provider is None:
        return []
    # Imported only when tracing is on: the instrumentation weighs a few MB in every process.
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=provider, filter_=_call_filter())]


def client_interceptors(
    tracer_provider: trace.TracerProvider | None = None,
) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for ``grpc.aio.insecure_channel(..., interceptors=...)``: a CLIENT span per
    call, and the current trace context sent along as ``traceparent``. Empty when tracing is off.
    """
    provider = _traced_provider(tracer_provider)
    if provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors  # as above

    interceptors: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(
        tracer_provider=provider, filter_=_call_filter()
    )
    return interceptors


@contextmanager
def stage_span(
    name: str,
    attributes: Attributes = None,
    start_time_ns: int | None = None,
    *,
    tracer_provider: trace.TracerProvider | None = None,
) -> Iterator[trace.Span]:
    """Time the ``with`` body as span ``name``, a child of the current span, made current.

    ``start_time_ns`` (Unix epoch ns) backdates the start, e.g. to when the request arrived.
    An exception escaping the body is recorded on the span and marks it ERROR, then propagates.
    """
    provider = _traced_provider(tracer_provider)
    if provider is None:
        yield trace.INVALID_SPAN
        return
    tracer = provider.get_tracer(_INSTRUMENTATION_NAME)
    with tracer.start_as_current_span(name, attributes=attributes, start_time=start_time_ns) as s:
        yield s


def record_span(
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: Attributes = None,
    parent_context: Context | None = None,
    *,
    tracer_provider: trace.TracerProvider | None = None,
) -> trace.Span:
    """Record an already finished stage as a span from ``start_ns`` to ``end_ns`` (epoch ns).

    For stages timed elsewhere (the engine thread stamps queue and compute times; the
    servicer records them afterwards). The parent is the current span, or the span in
    ``parent_context`` (``trace.set_span_in_context(span)`` / ``opentelemetry.context
    .get_current()`` captured earlier). Returns the ended span, whose context can parent
    further recorded spans.
    """
    if end_ns < start_ns:
        raise InvalidArgumentError("end_ns", f"{end_ns} is before start_ns {start_ns}")
    provider = _traced_provider(tracer_provider)
    if provider is None:
        return trace.INVALID_SPAN
    tracer = provider.get_tracer(_INSTRUMENTATION_NAME)
    span = tracer.start_span(
        name, context=parent_context, attributes=attributes, start_time=start_ns
    )
    span.end(end_time=end_ns)
    return span


def perf_to_epoch_ns(perf_s: float) -> int:
    """Convert a ``time.perf_counter()`` stamp to Unix epoch nanoseconds for ``record_span``.

    The engine stamps with the monotonic ``perf_counter``; spans need wall-clock times. Both
    clocks are read now and the stamp is placed at the same distance before the wall clock.
    """
    # The perf reading nearest the wall-clock reading: the mean of one before and one after.
    before = time.perf_counter()
    wall_ns = time.time_ns()
    now = (before + time.perf_counter()) / 2
    return wall_ns - round((now - perf_s) * 1e9)
