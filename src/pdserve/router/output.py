"""What the request flow streams back: chunks of tokens and text, and the final accounting."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.outputs import FinishReason
from pdserve.logprobs import PromptLogprobs, TopLogprobs
from pdserve.timing import Timing


@dataclass(frozen=True, slots=True)
class RouteUsage:
    """Token accounting of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens the worker served from its prefix cache."""


@dataclass(slots=True)
class RouteChunk:
    """One streamed piece of a response; the last one has ``finish_reason``, usage and timing."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: RouteUsage | None = None
    timing: Timing | None = None
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """The alternatives at each of ``token_ids`` (``SamplingParams.logprobs`` > 0)."""
    prompt_logprobs: PromptLogprobs | None = None
    """On the first chunk, when ``SamplingParams.prompt_logprobs`` asked for them."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
