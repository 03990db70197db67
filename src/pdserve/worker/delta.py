"""What a decode stream yields: ``DecodeDelta``, one engine step's tokens for one request; the
last one also says where the request's time went on this worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.outputs import FinishReason, RequestOutput
from pdserve.logprobs import PromptLogprobs, TopLogprobs
from pdserve.timing import RequestTiming, Timing
from pdserve.transfer.base import HandoffRecord


@dataclass(frozen=True, slots=True)
class Finished:
    """What the last delta of a stream carries besides its tokens."""

    timing: Timing
    """The figures (``RequestTiming.decode`` / ``.generate``)."""
    stamps: RequestTiming
    """The engine-thread stamps they were derived from (the stage spans)."""
    transfer: HandoffRecord | None = None
    """Decode: the receiver's measurements of the hand-off."""


@dataclass(frozen=True, slots=True)
class DecodeDelta:
    """The tokens of one engine step for one request."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    """Set on the last delta only."""
    finished: Finished | None = None
    """Set on the last delta only."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (``generate``, last delta only)."""
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """The alternatives at each token (``SamplingParams.logprobs`` > 0), else empty."""
    prompt_logprobs: PromptLogprobs | None = None
    """``generate``'s first delta, when ``SamplingParams.prompt_logprobs`` asked for them."""

    @property
    def timing(self) -> Timing | None:
        """The last delta's figures; None before it."""
        return self.finished.timing if self.finished is not None else None


def delta_of(
    out: RequestOutput, finished: Finished | None, *, num_cached_tokens: int
) -> DecodeDelta:
    """The delta of one engine output; ``finished`` on the last one."""
    return DecodeDelta(
        token_ids=list(out.new_token_ids),
        logprobs=list(out.new_logprobs),
        finish_reason=out.finish_reason if out.finished else None,
        finished=finished,
        num_cached_tokens=num_cached_tokens,
        top_logprobs=list(out.new_top_logprobs),
        prompt_logprobs=out.prompt_logprobs,
    )
