"""Observability for pdserve: OpenTelemetry traces, Prometheus metrics, latency-breakdown reports.

One noun per module, imported directly (this package imports nothing by itself, so that the
report command does not pay for the tracing SDK and the services do not pay for matplotlib):

* ``spans``: the stable span names and attribute keys every service uses.
* ``tracing``: ``init_tracing`` from the standard ``OTEL_*`` variables, gRPC interceptors,
  ``stage_span`` / ``record_span``.
* ``span_file``: the ``PDSERVE_SPAN_FILE`` JSON-lines exporter and its reader.
* ``record``: ``SpanRecord``, the exporter-neutral span the reports work on.
* ``jaeger``: loading traces from a Jaeger query service.
* ``breakdown``: per-request, per-stage durations and their percentiles.
* ``chart`` / ``html_report``: the PNG waterfall and the self-contained HTML page.
* ``report``: ``pdserve trace report``.
* ``metrics``: per-service Prometheus registries and the ``/metrics`` HTTP server.

See ``docs/observability.md`` for how a service wires these in.
"""
