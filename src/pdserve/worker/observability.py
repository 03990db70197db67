"""A worker's traces: stage spans from engine stamps, and KV transfer spans.

Stage spans are recorded after the fact from times measured where the work happened (the
engine thread's ``RequestTiming`` stamps, a transport's ``monotonic_ns`` stamps), so their
boundaries are exact and consecutive stages share them: ``prefill.queue`` ends where
``prefill.compute`` starts, ``decode.queue`` where ``decode.first_token`` starts, and so on.
Each is a child of the RPC's SERVER span (pass the context captured in the servicer as
``parent``; without it, the current span). The worker's metrics are ``worker_telemetry``'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue

from pdserve.errors import InvalidArgumentError
from pdserve.request_key import RequestKey
from pdserve.telemetry.spans import (
    ATTR_BANDWIDTH_MBPS,
    ATTR_BATCH_SIZE,
    ATTR_BYTES,
    ATTR_FALLBACK,
    ATTR_ITL_MAX_MS,
    ATTR_ITL_MEAN_MS,
    ATTR_OVERLAP_MS,
    ATTR_PREFIX_HIT_TOKENS,
    ATTR_REQUEST_ID,
    ATTR_TENANT,
    ATTR_TOKENS,
    ATTR_TRANSPORT,
    DECODE_FIRST_TOKEN,
    DECODE_GENERATE,
    DECODE_QUEUE,
    KV_TRANSFER_RECV,
    KV_TRANSFER_SEND,
    PREFILL_COMPUTE,
    PREFILL_QUEUE,
)
from pdserve.telemetry.tracing import perf_to_epoch_ns, record_span
from pdserve.timing import RequestTiming
from pdserve.transfer.record import HandoffRecord

SEND = "send"
RECV = "recv"


def monotonic_to_epoch_ns(mono_ns: int) -> int:
    """A ``time.monotonic_ns()`` stamp as Unix epoch nanoseconds (for ``record_span``)."""
    before = time.monotonic_ns()
    wall_ns = time.time_ns()
    now = (before + time.monotonic_ns()) // 2
    return wall_ns - (now - mono_ns)


def perf_to_monotonic_ns(perf_s: float) -> int:
    """A ``time.perf_counter()`` stamp on the ``time.monotonic_ns()`` clock."""
    return time.monotonic_ns() - round((time.perf_counter() - perf_s) * 1e9)


def transfer_window(stats: HandoffRecord, direction: str) -> tuple[int, int]:
    """``(start, end)`` monotonic ns of one side: the sender from its first layer written (or
    the commit's start, when nothing was written during the compute) to the commit; the
    receiver from the start of its read to a verified payload."""
    if direction == SEND:
        return stats.first_layer_ns or stats.send_start_ns, stats.send_end_ns
    if direction == RECV:
        return stats.recv_start_ns, stats.recv_end_ns
    raise InvalidArgumentError("direction", f"must be {SEND!r} or {RECV!r}, got {direction!r}")


def record_transfer_span(
    stats: HandoffRecord,
    parent: Context | None = None,
    *,
    direction: str | None = None,
    start_ns: int | None = None,
    end_ns: int | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> trace.Span:
    """Record ``kv.transfer.send`` or ``kv.transfer.recv`` from a transport's record.

    ``direction`` None takes the side ``stats`` has filled in (the receiver's when both are).
    The span covers the side's own window (``transfer_window``) unless ``start_ns`` /
    ``end_ns`` (Unix ns) widen it to the stage boundaries around it. Attributes: transport,
    bytes, bandwidth over the side's own window (MB/s), the part that overlapped the
    prefill's compute, and whether the hand-off fell back (``fallback_reason`` set). Returns a
    non-recording span when tracing is off or there is no window.
    """
    side = direction or (RECV if stats.recv_end_ns else SEND)
    mono_start, mono_end = transfer_window(stats, side)
    own = mono_start > 0 and mono_end >= mono_start
    offset = monotonic_to_epoch_ns(0)  # one reading for both ends: the span keeps its length
    start = start_ns if start_ns is not None else (mono_start + offset if own else None)
    end = end_ns if end_ns is not None else (mono_end + offset if own else None)
    if start is None or end is None or end < start:
        return trace.INVALID_SPAN
    seconds = (mono_end - mono_start) / 1e9 if own else 0.0
    attributes: dict[str, AttributeValue] = {
        ATTR_TRANSPORT: str(stats.transport),
        ATTR_BYTES: stats.num_bytes,
        ATTR_BANDWIDTH_MBPS: stats.num_bytes / seconds / 1e6 if seconds > 0 else 0.0,
        ATTR_OVERLAP_MS: stats.overlap_ms if side == SEND else 0.0,
        ATTR_FALLBACK: bool(stats.fallback_reason),
    }
    return record_span(
        KV_TRANSFER_SEND if side == SEND else KV_TRANSFER_RECV,
        start,
        end,
        attributes,
        parent,
        tracer_provider=tracer_provider,
    )


@dataclass(slots=True)
class TokenGaps:
    """Gaps between a stream's tokens as the worker's event loop receives them.

    An output of k tokens (several engine steps coalesced for a consumer that fell behind)
    spreads its gap evenly over its k tokens, as the router's inter-token latency does.
    """

    outputs: int = 0
    tokens: int = 0
    first_tokens: int = 0
    """Tokens of the first output: they have no gap before them."""
    last_at: float | None = None
    total_s: float = 0.0
    max_s: float = 0.0

    def add(self, num_tokens: int, at: float | None = None) -> None:
        """One output of ``num_tokens`` tokens arriving at ``at`` (``perf_counter``, now)."""
        if num_tokens <= 0:
            return
        now = time.perf_counter() if at is None else at
        if self.last_at is None:
            self.first_tokens = num_tokens
        else:
            gap = now - self.last_at
            self.total_s += gap
            self.max_s = max(self.max_s, gap / num_tokens)
        self.last_at = now
        self.outputs += 1
        self.tokens += num_tokens

    @property
    def mean_ms(self) -> float:
        """Mean gap per token after the first output's."""
        gapped = self.tokens - self.first_tokens
        return self.total_s / gapped * 1000.0 if gapped > 0 else 0.0

    @property
    def max_ms(self) -> float:
        return self.max_s * 1000.0


def perf_epoch_offset_ns() -> int:
    """Unix ns of ``perf_counter()`` zero, read now: ``offset + round(stamp * 1e9)``."""
    return perf_to_epoch_ns(0.0)


def stamps_ns(
    timing: RequestTiming, offset_ns: int | None = None
) -> tuple[int, int, int, int] | None:
    """``submitted``, ``first_step_start``, ``first_output``, ``last_output`` in Unix ns, or
    None if the request never produced an output. All four use one clock reading
    (``offset_ns``, default read now), so that consecutive stages stay adjacent; pass the
    same offset to every recorder of one request."""
    t = timing
    if t.first_step_start is None or t.first_output is None or t.last_output is None:
        return None
    offset = perf_epoch_offset_ns() if offset_ns is None else offset_ns
    return (
        offset + round(t.submitted * 1e9),
        offset + round(t.first_step_start * 1e9),
        offset + round(t.first_output * 1e9),
        offset + round(t.last_output * 1e9),
    )


def request_attributes(request_id: str) -> dict[str, AttributeValue]:
    """The span attributes naming a request: the caller's id and tenant, read back from the
    scoped id the router sent (``pdserve.request_key``), so that they match the router's
    ``router.request``; an id the router did not make (a direct call) as it is."""
    key = RequestKey.parse(request_id)
    if key is None:
        return {ATTR_REQUEST_ID: request_id}
    return {ATTR_REQUEST_ID: key.request_id, ATTR_TENANT: key.tenant}


def record_prefill_stages(
    timing: RequestTiming,
    *,
    request_id: str,
    prompt_tokens: int,
    cached_tokens: int,
    queue_start_ns: int | None = None,
    parent: Context | None = None,
    offset_ns: int | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> bool:
    """``prefill.queue`` (from ``queue_start_ns``, default the engine's ``submitted``) then
    ``prefill.compute`` (batch size, prompt tokens, prefix hits).

    False (nothing recorded) when the request never produced an output."""
    stamps = stamps_ns(timing, offset_ns)
    if stamps is None:
        return False
    submitted, started, first, _ = stamps
    queued = submitted if queue_start_ns is None else min(queue_start_ns, submitted)
    record_span(
        PREFILL_QUEUE, queued, started, request_attributes(request_id), parent,
        tracer_provider=tracer_provider,
    )  # fmt: skip
    record_span(
        PREFILL_COMPUTE,
        started,
        first,
        {
            ATTR_BATCH_SIZE: timing.first_batch_size,
            ATTR_TOKENS: prompt_tokens,
            ATTR_PREFIX_HIT_TOKENS: cached_tokens,
        },
        parent,
        tracer_provider=tracer_provider,
    )
    return True


def record_generate_stage(
    timing: RequestTiming,
    gaps: TokenGaps,
    parent: Context | None = None,
    *,
    end_ns: int | None = None,
    offset_ns: int | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> bool:
    """``decode.generate``: the first output to the last (or to ``end_ns``, when the last
    one was sent), one span for all decode steps."""
    stamps = stamps_ns(timing, offset_ns)
    if stamps is None:
        return False
    _, _, first, last = stamps
    record_span(
        DECODE_GENERATE,
        first,
        last if end_ns is None else max(end_ns, last),
        {ATTR_TOKENS: gaps.tokens, ATTR_ITL_MEAN_MS: gaps.mean_ms, ATTR_ITL_MAX_MS: gaps.max_ms},
        parent,
        tracer_provider=tracer_provider,
    )
    return True


def record_decode_stages(
    timing: RequestTiming,
    gaps: TokenGaps,
    *,
    request_id: str,
    end_ns: int | None = None,
    parent: Context | None = None,
    offset_ns: int | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> bool:
    """``decode.queue``, ``decode.first_token`` and ``decode.generate`` (to ``end_ns``, see
    ``record_generate_stage``) of a handed-over request (the KV installed, its first token
    already known from the prefill)."""
    offset_ns = perf_epoch_offset_ns() if offset_ns is None else offset_ns
    stamps = stamps_ns(timing, offset_ns)
    if stamps is None:
        return False
    submitted, started, first, _ = stamps
    attrs = request_attributes(request_id)
    record_span(DECODE_QUEUE, submitted, started, attrs, parent, tracer_provider=tracer_provider)
    record_span(DECODE_FIRST_TOKEN, started, first, attrs, parent, tracer_provider=tracer_provider)
    return record_generate_stage(
        timing, gaps, parent, end_ns=end_ns, offset_ns=offset_ns, tracer_provider=tracer_provider
    )
