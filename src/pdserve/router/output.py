"""What the request flow streams back: chunks of tokens and text, and the final accounting."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.outputs import FinishReason
from pdserve.v1 import common_pb2

RECOMPUTE = "recompute"
"""The transport name of a hand-off in which no KV moved: the decode worker prefilled."""


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

    def absorb_decode(self, decode: common_pb2.Timing) -> None:
        """Add the decode worker's measurements (its last chunk's timing) to the prefill's.

        The decode side's figures are the ones that held: when its receive failed, or when
        nothing was sent, it prefilled the prompt itself (``transport == "recompute"``). That
        recompute is prefill work on the request's path, so it adds to ``prefill_ms``; the
        failed receive's time stays in ``transfer_ms``, and no KV reached the decode worker.
        """
        self.queue_ms += decode.queue_ms
        self.prefill_ms += decode.prefill_ms
        self.transfer_ms += decode.transfer_ms
        self.decode_ms = decode.decode_ms
        if decode.transport:
            self.transport = decode.transport
        if decode.transport == RECOMPUTE:
            self.transfer_bytes = decode.transfer_bytes


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
