"""``StageRecorder``: the stage spans and transfer observations of the Prefill, Decode and
Mixed calls, recorded from hand-made worker results (stamps, transfer records), into an
in-memory tracer installed for the test only."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.engine.outputs import FinishReason
from pdserve.telemetry import tracing
from pdserve.timing import RequestTiming, Timing
from pdserve.transfer.record import HandoffRecord
from pdserve.worker.delta import DecodeDelta, Finished
from pdserve.worker.observability import RECV, SEND
from pdserve.worker.prefill import PrefillResult
from pdserve.worker.stages import StageRecorder
from pdserve.worker.worker_telemetry import WorkerTelemetry


@dataclass
class Observed:
    """Stands for ``WorkerTelemetry``: keeps what ``observe_transfer`` was given."""

    transfers: list[tuple[Any, str]] = field(default_factory=list)

    def observe_transfer(self, stats: Any, direction: str) -> None:
        self.transfers.append((stats, direction))


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Spans of the process-wide tracer, which the recorder uses, kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_installed_provider", lambda: provider)
    yield exporter
    provider.shutdown()


def names(exporter: InMemorySpanExporter) -> list[str]:
    return [s.name for s in exporter.get_finished_spans()]


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def stamps() -> RequestTiming:
    """perf_counter seconds just past: 2 ms queued, 5 ms to the first output, 30 ms more to
    the last."""
    t0 = time.perf_counter() - 1.0
    t = RequestTiming(submitted=t0)
    t.first_step_start, t.first_output, t.last_output = t0 + 0.002, t0 + 0.007, t0 + 0.037
    t.first_batch_size = 1
    return t


def prefill_result(
    *, transfer: HandoffRecord | None, timing: Timing | None = None
) -> PrefillResult:
    return PrefillResult(
        first_token_id=1,
        first_logprob=-0.5,
        kv=None,
        finish_reason=None,
        timing=timing or Timing(),
        num_cached_tokens=4,
        transfer=transfer,
        stamps=stamps(),
    )


def test_a_prefill_records_its_stages_and_the_send(exporter: InMemorySpanExporter) -> None:
    observed = Observed()
    recorder = StageRecorder(cast(WorkerTelemetry, observed))
    now = time.monotonic_ns()
    record = HandoffRecord(
        "shm", num_bytes=1000, send_start_ns=now - 900_000_000, first_layer_ns=now - 900_000_000,
        send_end_ns=now - 800_000_000,
    )  # fmt: skip
    call = recorder.prefill("r1", prompt_tokens=17)
    call.returned(prefill_result(transfer=record))
    spans = by_name(exporter)
    assert set(spans) == {"prefill.queue", "prefill.compute", "kv.transfer.send"}
    assert spans["prefill.queue"].end_time == spans["prefill.compute"].start_time
    assert (spans["prefill.compute"].attributes or {})["pdserve.tokens"] == 17
    assert observed.transfers == [(record, SEND)]


def test_a_send_without_a_record_is_measured_from_the_reported_duration(
    exporter: InMemorySpanExporter,
) -> None:
    observed = Observed()
    call = StageRecorder(cast(WorkerTelemetry, observed)).prefill("r2", prompt_tokens=3)
    call.returned(prefill_result(transfer=None, timing=Timing(transfer_ms=2.0, transfer_bytes=64)))
    assert "kv.transfer.send" in names(exporter)
    [(measured, direction)] = observed.transfers
    assert direction == SEND and isinstance(measured, HandoffRecord)
    assert (measured.transport, measured.num_bytes) == ("store", 64)
    assert measured.send_end_ns - measured.send_start_ns == 2_000_000


def test_a_prefill_that_moved_nothing_records_no_send(exporter: InMemorySpanExporter) -> None:
    observed = Observed()
    StageRecorder(cast(WorkerTelemetry, observed)).prefill("r3", 3).returned(
        prefill_result(transfer=None)
    )
    assert sorted(names(exporter)) == ["prefill.compute", "prefill.queue"]
    assert observed.transfers == []


def last_delta(transfer: HandoffRecord | None = None) -> DecodeDelta:
    timing = Timing(transport="shm", transfer_bytes=10)
    return DecodeDelta([9], [-0.1], FinishReason.LENGTH, Finished(timing, stamps(), transfer), 2)


def test_a_decode_records_the_receive_and_its_stages(exporter: InMemorySpanExporter) -> None:
    observed = Observed()
    call = StageRecorder(cast(WorkerTelemetry, observed)).decode("r4")
    call.sent(DecodeDelta([7], [-0.2]))
    call.sent(last_delta())
    assert names(exporter) == []  # nothing until the stream ends
    call.ended()
    spans = by_name(exporter)
    assert set(spans) == {"kv.transfer.recv", "decode.queue", "decode.first_token",
                          "decode.generate"}  # fmt: skip
    assert spans["kv.transfer.recv"].end_time == spans["decode.queue"].start_time
    assert (spans["decode.generate"].attributes or {})["pdserve.tokens"] == 2
    # No record from the transport: the receive is measured around it, under its name.
    [(received, direction)] = observed.transfers
    assert direction == RECV and isinstance(received, HandoffRecord)
    assert (received.transport, received.num_bytes) == ("shm", 10)


def test_a_stream_that_never_finished_records_nothing(exporter: InMemorySpanExporter) -> None:
    observed = Observed()
    recorder = StageRecorder(cast(WorkerTelemetry, observed))
    decode = recorder.decode("r5")
    decode.sent(DecodeDelta([7], [-0.2]))
    decode.ended()  # cancelled before its last delta
    generate = recorder.generate("r6", prompt_tokens=5)
    generate.ended()
    assert names(exporter) == [] and observed.transfers == []


def test_a_mixed_generate_records_prefill_and_generate(exporter: InMemorySpanExporter) -> None:
    call = StageRecorder().generate("r7", prompt_tokens=5)
    call.sent(DecodeDelta([7], [-0.2]))
    call.sent(last_delta())
    call.ended()
    spans = by_name(exporter)
    assert set(spans) == {"prefill.queue", "prefill.compute", "decode.generate"}
    assert (spans["prefill.compute"].attributes or {})["pdserve.prefix_hit_tokens"] == 2
