"""A worker call's stage spans and transfer metrics, recorded from the records it returns.

The servicers (``services.prefill``, ``services.decode``) wrap each call in one of these, by
composition: ``StageRecorder.prefill`` / ``.decode`` / ``.generate`` open a call at the
servicer boundary (where the caller's hand-over is read), see what the worker returned
(``PrefillResult``, each ``DecodeDelta``; the last carries ``Finished``) and record the stages
from the stamps in it. The workers themselves know no tracing. Without tracing the spans cost
one type check each; without a ``WorkerTelemetry`` no metric is kept.

The stages of one call follow each other without gaps, from where the caller handed the
request over (``pdserve.telemetry.handover``) to where the worker hands it back, and are
children of the request's root stage the caller handed over (``router.request``); without
one, of the call's SERVER span::

    Prefill:        prefill.queue | prefill.compute | kv.transfer.send
    Decode:         kv.transfer.recv | decode.queue | decode.first_token | decode.generate
    Mixed.Generate: prefill.queue | prefill.compute | decode.generate

* ``prefill.queue`` and (Mixed) start at the hand-over: the call's travel, the worker picking
  it up, the engine's queue, up to the step that starts the request's prefill;
* ``kv.transfer.send`` runs from the first KV ready to move (a layer during the compute, or
  the whole KV once the compute ended) to the prefill handing the request back, the commit
  included; that end is handed to the decode call;
* ``kv.transfer.recv`` runs from that hand-over to the decode engine taking the request: the
  answer's way back through the router, the Decode call, the read and check of the payload;
* ``decode.generate`` ends when the last token is handed to the stream (its last write).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import context as otel_context

from pdserve.telemetry import handover
from pdserve.transfer.record import HandoffRecord
from pdserve.worker.delta import DecodeDelta, Finished
from pdserve.worker.observability import (
    RECV,
    SEND,
    TokenGaps,
    monotonic_to_epoch_ns,
    perf_epoch_offset_ns,
    perf_to_monotonic_ns,
    record_decode_stages,
    record_generate_stage,
    record_prefill_stages,
    record_transfer_span,
    stamps_ns,
    transfer_window,
)
from pdserve.worker.prefill import PrefillResult
from pdserve.worker.worker_telemetry import WorkerTelemetry


class StageRecorder:
    """Opens the traced calls of one worker; ``telemetry`` None keeps no transfer metric."""

    def __init__(self, telemetry: WorkerTelemetry | None = None) -> None:
        self.telemetry = telemetry

    def prefill(self, request_id: str, prompt_tokens: int) -> PrefillCall:
        """A ``Prefill`` call starting now; ``returned`` with its result."""
        return PrefillCall(self.telemetry, request_id, prompt_tokens)

    def decode(self, request_id: str) -> DecodeCall:
        """A ``Decode`` call starting now; ``sent`` with each delta, ``ended`` at its end."""
        return DecodeCall(self.telemetry, request_id)

    def generate(self, request_id: str, prompt_tokens: int) -> GenerateCall:
        """A ``Mixed.Generate`` call starting now; ``sent`` with each delta, ``ended`` at its
        end."""
        return GenerateCall(request_id, prompt_tokens)


@dataclass(slots=True)
class PrefillCall:
    """One traced ``Prefill`` call: ``prefill.queue``, ``prefill.compute``, ``kv.transfer.send``."""

    telemetry: WorkerTelemetry | None
    request_id: str
    prompt_tokens: int
    parent: otel_context.Context | None = field(
        default_factory=lambda: handover.stage_parent(otel_context.get_current())
    )

    def returned(self, result: PrefillResult) -> None:
        """The worker answered with ``result``: record its stages and hand the end back."""
        returned_ns = time.time_ns()
        offset = perf_epoch_offset_ns()
        stamps = stamps_ns(result.stamps, offset) if result.stamps is not None else None
        if result.stamps is None or stamps is None:
            return
        record_prefill_stages(
            result.stamps,
            request_id=self.request_id,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=result.num_cached_tokens,
            queue_start_ns=handover.stage_start(stamps[0]),
            parent=self.parent,
            offset_ns=offset,
        )
        sent = _sent_record(result, returned_ns)
        if sent is None:
            handover.mark_stage_end(stamps[2])
            return
        start, _ = transfer_window(sent, SEND)
        record_transfer_span(
            sent,
            self.parent,
            direction=SEND,
            start_ns=min(stamps[2], monotonic_to_epoch_ns(start) if start else stamps[2]),
            end_ns=returned_ns,
        )
        if self.telemetry is not None:
            self.telemetry.observe_transfer(sent, SEND)
        handover.mark_stage_end(returned_ns)


def _sent_record(result: PrefillResult, returned_ns: int) -> HandoffRecord | None:
    """The transport's record; for one that keeps none, the duration it reports, ending as
    ``prefill`` returned (its last step is the commit)."""
    if result.transfer is not None:
        return result.transfer
    t = result.timing
    if t.transfer_bytes <= 0:
        return None
    end = time.monotonic_ns() - (time.time_ns() - returned_ns)
    return HandoffRecord(
        "store",
        t.transfer_bytes,
        send_start_ns=end - round(t.transfer_ms * 1e6),
        send_end_ns=end,
    )


@dataclass(slots=True)
class _Stream:
    """What a streaming call saw: the token gaps, the last delta's record and when it left."""

    gaps: TokenGaps = field(default_factory=TokenGaps)
    finished: Finished | None = None
    num_cached_tokens: int = 0
    sent_ns: int | None = None

    def sent(self, delta: DecodeDelta) -> None:
        self.gaps.add(len(delta.token_ids))
        if delta.finished is not None:
            self.finished, self.num_cached_tokens = delta.finished, delta.num_cached_tokens
            self.sent_ns = time.time_ns()  # the last chunk goes out now


@dataclass(slots=True)
class DecodeCall:
    """One traced ``Decode`` call: ``kv.transfer.recv`` and the decode stages."""

    telemetry: WorkerTelemetry | None
    request_id: str
    parent: otel_context.Context | None = field(
        default_factory=lambda: handover.stage_parent(otel_context.get_current())
    )
    called_mono: int = field(default_factory=time.monotonic_ns)
    start_ns: int = field(default_factory=lambda: handover.stage_start(time.time_ns()))
    stream: _Stream = field(default_factory=_Stream)

    def sent(self, delta: DecodeDelta) -> None:
        """``delta`` goes to the caller now."""
        self.stream.sent(delta)

    def ended(self) -> None:
        """The stream is over (finished, failed or cancelled): record what it did."""
        final = self.stream.finished
        if final is None:
            return
        stamps = final.stamps
        offset = perf_epoch_offset_ns()
        taken = stamps_ns(stamps, offset)
        if taken is None:
            return
        taken_mono = perf_to_monotonic_ns(stamps.submitted)
        received: HandoffRecord = final.transfer or HandoffRecord(
            final.timing.transport,
            final.timing.transfer_bytes,
            recv_start_ns=self.called_mono,
            recv_end_ns=taken_mono,
        )
        # The hand-over ends when the engine takes the request: decode.queue starts there.
        record_transfer_span(
            received,
            self.parent,
            direction=RECV,
            start_ns=min(self.start_ns, taken[0]),
            end_ns=taken[0],
        )
        if self.telemetry is not None:
            self.telemetry.observe_transfer(received, RECV)
        record_decode_stages(
            stamps,
            self.stream.gaps,
            request_id=self.request_id,
            end_ns=self.stream.sent_ns,
            parent=self.parent,
            offset_ns=offset,
        )


@dataclass(slots=True)
class GenerateCall:
    """One traced ``Mixed.Generate`` call: the prefill stages and ``decode.generate``."""

    request_id: str
    prompt_tokens: int
    parent: otel_context.Context | None = field(
        default_factory=lambda: handover.stage_parent(otel_context.get_current())
    )
    handed_ns: int = field(default_factory=lambda: handover.stage_start(time.time_ns()))
    stream: _Stream = field(default_factory=_Stream)

    def sent(self, delta: DecodeDelta) -> None:
        """``delta`` goes to the caller now."""
        self.stream.sent(delta)

    def ended(self) -> None:
        """The stream is over (finished, failed or cancelled): record what it did."""
        final = self.stream.finished
        if final is None:
            return
        offset = perf_epoch_offset_ns()
        record_prefill_stages(
            final.stamps,
            request_id=self.request_id,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.stream.num_cached_tokens,
            queue_start_ns=self.handed_ns,
            parent=self.parent,
            offset_ns=offset,
        )
        record_generate_stage(
            final.stamps,
            self.stream.gaps,
            self.parent,
            end_ns=self.stream.sent_ns,
            offset_ns=offset,
        )
