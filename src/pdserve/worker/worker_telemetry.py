"""A worker's Prometheus metrics, brought up to date at each scrape (``WorkerTelemetry``).

Owns the worker's ``WorkerMetrics`` and where each figure comes from: queue depth and KV
blocks from the engine's published capacity at scrape time (no polling task), the host lease's
totals from its stats, heartbeat Redis failures from the heartbeat's own counter, the KV links'
live bandwidth from the connectors' ``BandwidthMeter``s; transfers are observed as they finish.
Apart from the stage spans (``observability``), which are recorded per call, not per scrape.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from prometheus_client import CollectorRegistry, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from pdserve.backends import EngineBackend
from pdserve.compute import HostLease
from pdserve.telemetry.metrics import WorkerMetrics
from pdserve.telemetry.service import MetricsEndpoint, ServiceTelemetry
from pdserve.transfer.bandwidth import SAME_HOST, BandwidthMeter
from pdserve.transfer.handle import TransportKind
from pdserve.transfer.links import Links
from pdserve.transfer.record import HandoffRecord
from pdserve.worker.heartbeat import WorkerHeartbeat
from pdserve.worker.observability import transfer_window


class _RefreshOnScrape(Collector):
    """Registered before the metrics it refreshes, so a scrape reads fresh values."""

    def __init__(self, telemetry: WorkerTelemetry) -> None:
        self._telemetry = telemetry

    def collect(self) -> Iterable[Metric]:
        self._telemetry.refresh()
        return []


class WorkerTelemetry:
    """The metrics of one worker process (``role``: prefill, decode, mixed, kvstore).

    ``start`` also installs tracing and serves ``/metrics`` (``ServiceTelemetry``); a service
    calls it before opening any channel and ``close()`` on its way out.
    """

    def __init__(
        self,
        role: str,
        engine: EngineBackend | None = None,
        *,
        process: bool = True,
        model_name: str | None = None,
    ) -> None:
        """``model_name``: the served model's name, for the vLLM-named metrics of an
        engine's worker (``telemetry.vllm_metrics``)."""
        self.engine = engine
        self.service: ServiceTelemetry | None = None
        self._heartbeat: WorkerHeartbeat | None = None
        self._redis_errors_seen = 0
        self._failures_seen = (0, 0)  # the engine's failed steps and requests, counted so far
        self._bandwidth: list[tuple[str, BandwidthMeter, Links]] = []
        registry = CollectorRegistry()
        if process:
            ProcessCollector(registry=registry)
        registry.register(_RefreshOnScrape(self))
        self.metrics = WorkerMetrics(role, registry, model_name=model_name)
        self.registry = registry

    @classmethod
    def start(
        cls,
        service_name: str,
        role: str,
        engine: EngineBackend | None = None,
        *,
        host: str = "127.0.0.1",
        endpoint: MetricsEndpoint | None = None,
        model_name: str | None = None,
    ) -> WorkerTelemetry:
        """Metrics for ``role`` served at ``endpoint``; tracing as ``service_name``."""
        telemetry = cls(role, engine, model_name=model_name)
        telemetry.service = ServiceTelemetry.start(
            service_name, telemetry.registry, host=host, endpoint=endpoint
        )
        return telemetry

    @property
    def metrics_url(self) -> str | None:
        return None if self.service is None else self.service.metrics_url

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """For the worker's gRPC server: SERVER spans and stage hand-over (after ``start``)."""
        return [] if self.service is None else self.service.server_interceptors()

    def close(self) -> None:
        """Stop serving metrics and flush the spans (after ``start``)."""
        if self.service is not None:
            self.service.close()
            self.service = None

    def watch_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        """Count the heartbeat's failed Redis writes as ``operation="heartbeat"`` errors."""
        self._heartbeat = heartbeat
        self._redis_errors_seen = heartbeat.errors

    def watch_bandwidth(self, direction: str, meter: BandwidthMeter, links: Links) -> None:
        """Export ``meter``'s live bytes/s as ``direction`` (send: a prefill connector's,
        recv: a decode connector's), and the capacity ``links`` believes of each link."""
        self._bandwidth.append((direction, meter, links))

    def _refresh_bandwidth(self) -> None:
        kinds = {k.value: k for k in TransportKind}
        capacity: dict[tuple[str, str], float] = {}
        for direction, meter, links in self._bandwidth:
            for rate in meter.rates():
                self.metrics.set_link_rate(
                    rate.link, rate.transport, direction,
                    average_bps=rate.average_bps, peak_bps=rate.peak_bps,
                )  # fmt: skip
                kind = kinds.get(rate.transport)
                if kind is not None:
                    peer = links.host if rate.link == SAME_HOST else rate.link
                    bps = links.link(peer, kind).bytes_per_s
                    key = (rate.link, rate.transport)
                    # Both sides of a colocated worker: the larger figure of the two.
                    capacity[key] = max(capacity.get(key, 0.0), bps)
        for (link, transport), bps in capacity.items():
            self.metrics.set_link_capacity(link, transport, bps)

    def refresh(self) -> None:
        """Bring the gauges (and the heartbeat error count) up to date; runs at every scrape,
        on the metrics server's thread: it reads only snapshots the engine publishes."""
        if self.engine is not None:
            load = self.engine.capacity()
            self.metrics.set_engine_load(
                running=load.running,
                waiting=load.waiting,
                free=load.blocks_free,
                total=load.blocks_total,
            )
            gate = self.engine.gate
            if isinstance(gate, HostLease):
                lease = gate.stats
                self.metrics.lease.record(
                    interactive_steps=lease.interactive_steps,
                    bulk_steps=lease.bulk_steps,
                    interactive_wait_s=lease.interactive_wait_s,
                    bulk_wait_s=lease.bulk_wait_s,
                    paced_s=lease.paced_s,
                    lent_s=lease.lent_s,
                    splits=lease.splits,
                )
            steps, requests = self._failures_seen
            self.metrics.count_engine_failures("step", load.failed_steps - steps)
            self.metrics.count_engine_failures("request", load.failed_requests - requests)
            self._failures_seen = (load.failed_steps, load.failed_requests)
        self._refresh_bandwidth()
        if self._heartbeat is not None:
            errors = self._heartbeat.errors
            for _ in range(errors - self._redis_errors_seen):
                self.metrics.count_redis_error("heartbeat")
            self._redis_errors_seen = errors

    def observe_transfer(self, stats: HandoffRecord, direction: str) -> None:
        """One finished side of a hand-off: counted by transport and outcome, and its bytes and
        seconds (those only if something moved)."""
        if stats.transport:
            self.metrics.count_handoff(
                str(stats.transport), direction, fallback=bool(stats.fallback_reason)
            )
        start, end = transfer_window(stats, direction)
        if start and end >= start:
            self.metrics.observe_transfer(
                str(stats.transport), direction, stats.num_bytes, (end - start) / 1e9
            )
