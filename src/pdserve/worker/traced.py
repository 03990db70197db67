"""Prefill and decode workers that trace their stages and count their transfers.

``TracedPrefillWorker`` and ``TracedDecodeWorker`` are the workers the services run: the
plain ``PrefillWorker`` / ``DecodeWorker`` plus, for every request, its stage spans and the
transfer metrics of its KV hand-off. Without tracing the spans cost one type check each; without a
``WorkerTelemetry`` no metric is kept.

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
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context

from pdserve.telemetry import handover
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.delta import DecodeDelta, StreamTiming
from pdserve.worker.observability import (
    RECV,
    SEND,
    TokenGaps,
    TransferTimes,
    WorkerTelemetry,
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
from pdserve.worker.prefill import PrefillResult, PrefillWorker


@dataclass(frozen=True, slots=True)
class MeasuredTimes:
    """One side of a hand-off measured around a transport that keeps no record of its own
    (``time.monotonic_ns`` stamps, like the transports' records)."""

    transport: str
    num_bytes: int
    send_start_ns: int = 0
    send_end_ns: int = 0
    recv_start_ns: int = 0
    recv_end_ns: int = 0
    first_layer_ns: int = 0
    fallback_reason: str = ""
    overlap_ms: float = 0.0


class TracedPrefillWorker(PrefillWorker):
    """A ``PrefillWorker`` recording ``prefill.queue``, ``prefill.compute`` and
    ``kv.transfer.send`` per request; takes ``PrefillWorker``'s arguments plus ``telemetry``."""

    def __init__(self, *args: Any, telemetry: WorkerTelemetry | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.telemetry = telemetry

    async def prefill(
        self, request_id: str, prompt_ids: Sequence[int], *args: Any, **kwargs: Any
    ) -> PrefillResult:
        parent = handover.stage_parent(otel_context.get_current())
        result = await super().prefill(request_id, prompt_ids, *args, **kwargs)
        returned_ns = time.time_ns()
        offset = perf_epoch_offset_ns()
        stamps = stamps_ns(result.timing, offset) if result.timing is not None else None
        if result.timing is None or stamps is None:
            return result
        record_prefill_stages(
            result.timing,
            request_id=request_id,
            prompt_tokens=len(prompt_ids),
            cached_tokens=result.num_cached_tokens,
            queue_start_ns=handover.stage_start(stamps[0]),
            parent=parent,
            offset_ns=offset,
        )
        sent = self._sent_record(result, returned_ns)
        if sent is None:
            handover.mark_stage_end(stamps[2])
            return result
        start, _ = transfer_window(sent, SEND)
        record_transfer_span(
            sent,
            parent,
            direction=SEND,
            start_ns=min(stamps[2], monotonic_to_epoch_ns(start) if start else stamps[2]),
            end_ns=returned_ns,
        )
        if self.telemetry is not None:
            self.telemetry.observe_transfer(sent, SEND)
        handover.mark_stage_end(returned_ns)
        return result

    @staticmethod
    def _sent_record(result: PrefillResult, returned_ns: int) -> TransferTimes | None:
        """The transport's record; for one that keeps none, the duration it reports, ending
        as ``prefill`` returned (its last step is the commit)."""
        if result.transfer is not None:
            return result.transfer
        if result.transfer_bytes <= 0:
            return None
        end = time.monotonic_ns() - (time.time_ns() - returned_ns)
        return MeasuredTimes(
            "store",
            result.transfer_bytes,
            send_start_ns=end - round(result.transfer_ms * 1e6),
            send_end_ns=end,
        )


class TracedDecodeWorker(DecodeWorker):
    """A ``DecodeWorker`` recording ``kv.transfer.recv`` and the decode stages (or, for a
    colocated request, the prefill stages and ``decode.generate``) per request; takes
    ``DecodeWorker``'s arguments plus ``telemetry``."""

    def __init__(self, *args: Any, telemetry: WorkerTelemetry | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.telemetry = telemetry

    async def decode(
        self, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[DecodeDelta, None]:
        parent = handover.stage_parent(otel_context.get_current())
        called_mono = time.monotonic_ns()
        start_ns = handover.stage_start(time.time_ns())
        gaps = TokenGaps()
        final: StreamTiming | None = None
        sent_ns: int | None = None
        try:
            async with aclosing(super().decode(request_id, *args, **kwargs)) as stream:
                async for delta in stream:
                    gaps.add(len(delta.token_ids))
                    final = delta.timing or final
                    if delta.timing is not None:
                        sent_ns = time.time_ns()  # the last chunk goes out now
                    yield delta
        finally:
            if final is not None and final.stamps is not None:
                self._record_decode(final, request_id, called_mono, start_ns, gaps, sent_ns, parent)

    def _record_decode(
        self,
        final: StreamTiming,
        request_id: str,
        called_mono: int,
        start_ns: int,
        gaps: TokenGaps,
        sent_ns: int | None,
        parent: otel_context.Context | None,
    ) -> None:
        stamps = final.stamps
        offset = perf_epoch_offset_ns()
        taken = stamps_ns(stamps, offset) if stamps is not None else None
        if stamps is None or taken is None:
            return
        taken_mono = perf_to_monotonic_ns(stamps.submitted)
        received: TransferTimes = final.transfer or MeasuredTimes(
            final.transport, final.transfer_bytes, recv_start_ns=called_mono, recv_end_ns=taken_mono
        )
        # The hand-over ends when the engine takes the request: decode.queue starts there.
        record_transfer_span(
            received,
            parent,
            direction=RECV,
            start_ns=min(start_ns, taken[0]),
            end_ns=taken[0],
        )
        if self.telemetry is not None:
            self.telemetry.observe_transfer(received, RECV)
        record_decode_stages(
            stamps, gaps, request_id=request_id, end_ns=sent_ns, parent=parent, offset_ns=offset
        )

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], *args: Any, **kwargs: Any
    ) -> AsyncGenerator[DecodeDelta, None]:
        parent = handover.stage_parent(otel_context.get_current())
        handed_ns = handover.stage_start(time.time_ns())
        gaps = TokenGaps()
        final: StreamTiming | None = None
        cached = 0
        sent_ns: int | None = None
        try:
            async with aclosing(super().generate(request_id, prompt_ids, *args, **kwargs)) as s:
                async for delta in s:
                    gaps.add(len(delta.token_ids))
                    if delta.timing is not None:
                        final, cached = delta.timing, delta.num_cached_tokens
                        sent_ns = time.time_ns()  # the last chunk goes out now
                    yield delta
        finally:
            if final is not None and final.stamps is not None:
                offset = perf_epoch_offset_ns()
                record_prefill_stages(
                    final.stamps,
                    request_id=request_id,
                    prompt_tokens=len(prompt_ids),
                    cached_tokens=cached,
                    queue_start_ns=handed_ns,
                    parent=parent,
                    offset_ns=offset,
                )
                record_generate_stage(final.stamps, gaps, parent, end_ns=sent_ns, offset_ns=offset)
