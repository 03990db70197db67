"""What a decode stream yields: ``DecodeDelta``, one engine step's tokens for one request,
and on the last one ``StreamTiming``, where the request's time went on this worker."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.outputs import FinishReason, RequestOutput
from pdserve.timing import RequestTiming
from pdserve.worker.handoff import TransferRecord


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """Where the time of one streamed request went (milliseconds); sent with the last delta."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    """Mixed: the prefill. Decode: the prefill this worker ran itself (recompute)."""
    transfer_ms: float = 0.0
    """Decode: receiving the KV (a failed attempt included), until it was ready to import."""
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    transfer_bytes: int = 0
    transport: str = ""
    transfer: TransferRecord | None = None
    """Decode: the receiver's measurements of the hand-off."""
    stamps: RequestTiming | None = None
    """The engine-thread stamps of the request on this worker."""


@dataclass(frozen=True, slots=True)
class DecodeDelta:
    """The tokens of one engine step for one request."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    """Set on the last delta only."""
    timing: StreamTiming | None = None
    """Set on the last delta only."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (``generate``, last delta only)."""


def delta_of(
    out: RequestOutput, timing: StreamTiming | None, *, num_cached_tokens: int
) -> DecodeDelta:
    """The delta of one engine output; ``timing`` on the last one."""
    return DecodeDelta(
        token_ids=list(out.new_token_ids),
        logprobs=list(out.new_logprobs),
        finish_reason=out.finish_reason if out.finished else None,
        timing=timing,
        num_cached_tokens=num_cached_tokens,
    )
