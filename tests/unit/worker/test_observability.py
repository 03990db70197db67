"""A worker's stage spans, transfer spans and metrics, against hand-made stamps and records."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.backends import Capacity
from pdserve.compute import HostLease
from pdserve.engine.gate import UNGATED, ComputeGate
from pdserve.request_key import RequestKey
from pdserve.timing import RequestTiming
from pdserve.transfer.bandwidth import SAME_HOST, BandwidthMeter
from pdserve.transfer.handle import TransportKind
from pdserve.transfer.links import PRIORS, Links
from pdserve.worker import observability as obs
from pdserve.worker.worker_telemetry import WorkerTelemetry


@dataclass(frozen=True)
class Record:
    """A transport's record (the ``HandoffRecord`` fields it reads), monotonic ns."""

    transport: str = "store"
    num_bytes: int = 0
    send_start_ns: int = 0
    first_layer_ns: int = 0
    send_end_ns: int = 0
    recv_start_ns: int = 0
    recv_end_ns: int = 0
    fallback_reason: str = ""
    overlap_ms: float = 0.0


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(exporter))
    yield p
    p.shutdown()


def _by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def _duration(span: ReadableSpan) -> int:
    assert span.start_time is not None and span.end_time is not None
    return span.end_time - span.start_time


def test_send_span_covers_first_layer_to_commit(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    record = Record(
        num_bytes=4_000_000, send_start_ns=1_000_000, first_layer_ns=3_000_000,
        send_end_ns=11_000_000, overlap_ms=2.5,
    )  # fmt: skip
    obs.record_transfer_span(record, direction=obs.SEND, tracer_provider=provider)
    span = _by_name(exporter)["kv.transfer.send"]
    assert _duration(span) == 8_000_000  # first layer -> commit, nothing before it
    attrs = span.attributes or {}
    assert attrs["pdserve.transport"] == "store"
    assert attrs["pdserve.bytes"] == 4_000_000
    assert attrs["pdserve.bandwidth_MBps"] == pytest.approx(4.0 / 0.008)
    assert attrs["pdserve.overlap_ms"] == 2.5
    assert attrs["pdserve.fallback"] is False


def test_recv_span_stretched_to_the_stage_boundaries_keeps_the_reads_bandwidth(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    record = Record(
        transport="shm", num_bytes=1_000_000, recv_start_ns=5_000_000, recv_end_ns=7_000_000,
        fallback_reason="peer gone",
    )  # fmt: skip
    start, end = 1_700_000_000_000_000_000, 1_700_000_000_010_000_000
    obs.record_transfer_span(record, start_ns=start, end_ns=end, tracer_provider=provider)
    span = _by_name(exporter)["kv.transfer.recv"]  # the side the record filled in
    assert (span.start_time, span.end_time) == (start, end)
    attrs = span.attributes or {}
    assert attrs["pdserve.bandwidth_MBps"] == pytest.approx(1.0 / 0.002)
    assert attrs["pdserve.overlap_ms"] == 0.0
    assert attrs["pdserve.fallback"] is True


def test_a_side_without_a_window_records_nothing(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    span = obs.record_transfer_span(Record(), direction=obs.SEND, tracer_provider=provider)
    assert not span.is_recording()
    assert exporter.get_finished_spans() == ()


def _timing() -> RequestTiming:
    # perf_counter seconds: 2 ms queued, 5 ms to the first output, 30 ms more to the last.
    t = RequestTiming(submitted=100.000)
    t.first_step_start, t.first_output, t.last_output = 100.002, 100.007, 100.037
    t.first_batch_size = 3
    return t


def test_prefill_stages_follow_each_other(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    timing = _timing()
    stamps = obs.stamps_ns(timing)
    assert stamps is not None
    handed = stamps[0] - 4_000_000  # the caller's part ended 4 ms before the engine took it
    assert obs.record_prefill_stages(
        timing, request_id="r1", prompt_tokens=17, cached_tokens=5, queue_start_ns=handed,
        tracer_provider=provider,
    )  # fmt: skip
    spans = _by_name(exporter)
    queue, compute = spans["prefill.queue"], spans["prefill.compute"]
    assert queue.start_time == handed
    assert queue.end_time == compute.start_time
    assert _duration(queue) == pytest.approx(6_000_000, abs=1_000)
    assert _duration(compute) == pytest.approx(5_000_000, abs=1_000)
    assert (compute.attributes or {}) == {
        "pdserve.batch_size": 3, "pdserve.tokens": 17, "pdserve.prefix_hit_tokens": 5,
    }  # fmt: skip


def test_decode_stages_follow_each_other_up_to_the_last_write(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    timing = _timing()
    gaps = obs.TokenGaps()
    for at in (100.007, 100.017, 100.022, 100.037):
        gaps.add(1, at)
    gaps.add(0, 100.050)  # an output without tokens is no token and no gap
    stamps = obs.stamps_ns(timing)
    assert stamps is not None
    sent = stamps[3] + 1_000_000
    assert obs.record_decode_stages(
        timing, gaps, request_id="r2", end_ns=sent, tracer_provider=provider
    )
    spans = _by_name(exporter)
    queue, first, generate = (spans[n] for n in ("decode.queue", "decode.first_token",
                                                 "decode.generate"))  # fmt: skip
    assert queue.end_time == first.start_time and first.end_time == generate.start_time
    assert generate.end_time == sent
    attrs = generate.attributes or {}
    assert attrs["pdserve.tokens"] == 4
    assert attrs["pdserve.itl_mean_ms"] == pytest.approx(10.0)  # (37 - 7) ms over 3 gaps
    assert attrs["pdserve.itl_max_ms"] == pytest.approx(15.0)


def test_stage_spans_name_the_callers_id_and_tenant(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    # The router sends the id scoped by tenant; the spans show what the caller knows, as
    # router.request does. An id the router did not make (a direct call) shows as it is.
    scoped = RequestKey("acme", "r@1#2").scoped_id
    assert obs.record_prefill_stages(
        _timing(), request_id=scoped, prompt_tokens=3, cached_tokens=0, tracer_provider=provider
    )
    assert obs.record_decode_stages(
        _timing(), obs.TokenGaps(), request_id=scoped, tracer_provider=provider
    )
    for name in ("prefill.queue", "decode.queue", "decode.first_token"):
        assert (_by_name(exporter)[name].attributes or {}) == {
            "pdserve.request_id": "r@1#2", "pdserve.tenant": "acme",
        }, name  # fmt: skip
    exporter.clear()
    assert obs.record_prefill_stages(
        _timing(), request_id="direct", prompt_tokens=3, cached_tokens=0, tracer_provider=provider
    )
    assert (_by_name(exporter)["prefill.queue"].attributes or {}) == {
        "pdserve.request_id": "direct"
    }


def test_a_coalesced_output_spreads_its_gap_over_its_tokens() -> None:
    gaps = obs.TokenGaps()
    gaps.add(1, 10.000)
    gaps.add(1, 10.010)  # one token 10 ms later
    gaps.add(3, 10.040)  # three tokens that waited together: 30 ms, 10 ms each
    assert gaps.tokens == 5 and gaps.outputs == 3
    assert gaps.mean_ms == pytest.approx(10.0)  # 40 ms over the 4 tokens after the first
    assert gaps.max_ms == pytest.approx(10.0)


def test_a_request_that_never_ran_has_no_stages(provider: TracerProvider) -> None:
    assert obs.stamps_ns(RequestTiming()) is None
    assert not obs.record_prefill_stages(
        RequestTiming(), request_id="r", prompt_tokens=1, cached_tokens=0,
        tracer_provider=provider,
    )  # fmt: skip


class _Engine:
    def __init__(self, gate: ComputeGate = UNGATED) -> None:
        self.waiting, self.free = 3, 40
        self.gate = gate
        self.failed_steps, self.failed_requests = 0, 0

    def capacity(self) -> Capacity:
        return Capacity(
            64, self.free, 16, queued_tokens=0, running=1, waiting=self.waiting,
            failed_steps=self.failed_steps, failed_requests=self.failed_requests,
        )  # fmt: skip


class _Heartbeat:
    errors = 2


def _samples(
    telemetry: WorkerTelemetry,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(telemetry.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_gauges_and_heartbeat_errors_are_read_at_scrape_time() -> None:
    engine, heartbeat = _Engine(), _Heartbeat()
    telemetry = WorkerTelemetry("decode", engine, process=False)  # type: ignore[arg-type]
    telemetry.watch_heartbeat(heartbeat)  # type: ignore[arg-type]
    first = _samples(telemetry)
    assert first[("pdserve_queue_depth", (("role", "decode"),))] == 3
    assert first[("pdserve_kv_blocks_free", (("role", "decode"),))] == 40
    assert first[("pdserve_kv_blocks_total", (("role", "decode"),))] == 64
    assert ("pdserve_redis_errors_total", (("operation", "heartbeat"),)) not in first
    # Two failures happened before the watch began; three since.
    engine.waiting, engine.free, heartbeat.errors = 0, 64, 5
    engine.failed_steps, engine.failed_requests = 2, 5
    second = _samples(telemetry)
    assert second[("pdserve_queue_depth", (("role", "decode"),))] == 0
    assert second[("pdserve_kv_blocks_free", (("role", "decode"),))] == 64
    assert second[("pdserve_redis_errors_total", (("operation", "heartbeat"),))] == 3
    assert second[("pdserve_engine_failures_total", (("kind", "step"),))] == 2
    assert second[("pdserve_engine_failures_total", (("kind", "request"),))] == 5
    engine.failed_requests = 6  # counted once, then only what is new
    third = _samples(telemetry)
    assert third[("pdserve_engine_failures_total", (("kind", "step"),))] == 2
    assert third[("pdserve_engine_failures_total", (("kind", "request"),))] == 6


def test_host_lease_totals_advance_at_scrape_time(tmp_path: Path) -> None:
    lease = HostLease(tmp_path, bulk_tokens=10)
    telemetry = WorkerTelemetry("mixed", _Engine(lease), process=False)  # type: ignore[arg-type]
    for tokens in (0, 3, 11):
        with lease.hold(tokens):
            pass
    first = _samples(telemetry)
    assert first[("pdserve_core_steps_total", (("kind", "interactive"),))] == 2
    assert first[("pdserve_core_steps_total", (("kind", "bulk"),))] == 1
    with lease.hold(0):
        pass
    second = _samples(telemetry)
    assert second[("pdserve_core_steps_total", (("kind", "interactive"),))] == 3
    assert second[("pdserve_core_wait_seconds_total", (("kind", "bulk"),))] >= 0


def test_transfers_count_bytes_and_seconds_of_their_own_window() -> None:
    telemetry = WorkerTelemetry("prefill", process=False)
    telemetry.observe_transfer(
        Record(num_bytes=1000, first_layer_ns=2_000_000, send_end_ns=6_000_000), obs.SEND
    )
    telemetry.observe_transfer(Record(num_bytes=500), obs.SEND)  # never sent: not counted
    samples = _samples(telemetry)
    labels = (("direction", "send"), ("transport", "store"))
    assert samples[("pdserve_kv_transfer_bytes_total", labels)] == 1000
    assert samples[("pdserve_kv_transfer_seconds_count", labels)] == 1
    assert samples[("pdserve_kv_transfer_seconds_sum", labels)] == pytest.approx(0.004)


def test_link_bandwidth_and_capacity_are_read_at_scrape_time() -> None:
    now = [20 * 10**9]
    send, recv = BandwidthMeter(lambda: now[0]), BandwidthMeter(lambda: now[0])
    links = Links("p-host")
    links.measure("d-host", TransportKind.DIRECT, 2_000_000, 0.011)  # 2 MB in 10 ms: 200 MB/s
    telemetry = WorkerTelemetry("mixed", process=False)
    telemetry.watch_bandwidth(obs.SEND, send, links)
    telemetry.watch_bandwidth(obs.RECV, recv, Links("p-host"))
    # 50 MB in 50 ms to d-host; 4 MB over 200 ms read from this host's own shm.
    send.record("d-host", "direct", 50_000_000, 15 * 10**9, 15 * 10**9 + 50_000_000)
    recv.record(SAME_HOST, "shm", 4_000_000, 16 * 10**9, 16 * 10**9 + 200_000_000)
    samples = _samples(telemetry)

    def rate(name: str, link: str, transport: str, direction: str, window: str) -> float:
        labels = (
            ("direction", direction), ("link", link), ("transport", transport), ("window", window)
        )  # fmt: skip
        return samples[(name, labels)]

    avg, peak = "pdserve_kv_transfer_bytes_per_second", "pdserve_kv_transfer_peak_bytes_per_second"
    assert rate(avg, "d-host", "direct", "send", "10s") == pytest.approx(5e6)
    assert rate(peak, "d-host", "direct", "send", "100ms") == pytest.approx(500e6)
    assert rate(avg, SAME_HOST, "shm", "recv", "10s") == pytest.approx(0.4e6)
    assert rate(peak, SAME_HOST, "shm", "recv", "100ms") == pytest.approx(20e6)
    capacity = "pdserve_kv_link_capacity_bytes_per_second"
    assert samples[(capacity, (("link", "d-host"), ("transport", "direct")))] == pytest.approx(
        200e6
    )
    assert (
        samples[(capacity, (("link", SAME_HOST), ("transport", "shm")))]
        == PRIORS[TransportKind.SHM]
    )
    now[0] += 10 * 10**9  # ten seconds later the link is idle again
    assert _samples(telemetry)[
        ("pdserve_kv_transfer_peak_bytes_per_second",
         (("direction", "send"), ("link", "d-host"), ("transport", "direct"), ("window", "100ms")))
    ] == 0.0  # fmt: skip
