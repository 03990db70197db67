"""What the request flow streams back: chunks of tokens and text, and the final accounting."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.outputs import FinishReason


@dataclass(frozen=True, slots=True)
class RouteUsage:
    """Token accounting of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens the worker served from its prefix cache."""


@dataclass(slots=True)
class RouteTiming:
    """Where the time of one request went, in milliseconds (bytes for ``transfer_bytes``).

    ``queue_ms`` covers the scheduler decision and the worker queues; ``ttft_ms`` and ``e2e_ms``
    are measured by the router from the moment the request arrived.
    """

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    transfer_bytes: int = 0
    transport: str = ""


@dataclass(slots=True)
class RouteChunk:
    """One streamed piece of a response; the last one has ``finish_reason``, usage and timing."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: RouteUsage | None = None
    timing: RouteTiming | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
