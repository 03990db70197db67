"""What the SDK returns: streamed deltas and whole completions."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.rpc.convert import finish_reason_name, timing_from_proto
from pdserve.timing import Timing
from pdserve.v1 import common_pb2, router_pb2


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens served from a worker's prefix cache."""

    @classmethod
    def from_proto(cls, msg: common_pb2.Usage) -> Usage:
        return cls(msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens)


@dataclass(frozen=True, slots=True)
class Delta:
    """One streamed piece: new tokens and text; the last one carries finish_reason and totals."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    """None until the last delta: then "stop", "length", "abort" or "error"."""
    usage: Usage | None = None
    timing: Timing | None = None
    request_id: str = ""
    """Set on the first delta."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_proto(cls, msg: router_pb2.GenerateChunk) -> Delta:
        return cls(
            text=msg.text,
            token_ids=list(msg.token_ids),
            logprobs=list(msg.logprobs),
            finish_reason=finish_reason_name(msg.finish_reason),
            usage=Usage.from_proto(msg.usage) if msg.HasField("usage") else None,
            timing=timing_from_proto(msg.timing) if msg.HasField("timing") else None,
            request_id=msg.request_id,
        )


@dataclass(slots=True)
class Completion:
    """A finished request."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    usage: Usage | None
    timing: Timing | None
    request_id: str = ""

    @classmethod
    def from_proto(cls, msg: router_pb2.GenerateResponse) -> Completion:
        return cls(
            text=msg.text,
            token_ids=list(msg.token_ids),
            logprobs=list(msg.logprobs),
            finish_reason=finish_reason_name(msg.finish_reason),
            usage=Usage.from_proto(msg.usage) if msg.HasField("usage") else None,
            timing=timing_from_proto(msg.timing) if msg.HasField("timing") else None,
            request_id=msg.request_id,
        )


@dataclass(slots=True)
class CompletionBuilder:
    """Accumulates deltas into a Completion."""

    request_id: str = ""
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    last: Delta | None = None

    def add(self, delta: Delta) -> None:
        self.request_id = self.request_id or delta.request_id
        self.text_parts.append(delta.text)
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.last = delta

    @property
    def started(self) -> bool:
        """True once any token has arrived (after that a request is never retried)."""
        return bool(self.token_ids)

    def completion(self) -> Completion:
        last = self.last
        return Completion(
            text="".join(self.text_parts),
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            finish_reason=last.finish_reason if last else None,
            usage=last.usage if last else None,
            timing=last.timing if last else None,
            request_id=self.request_id,
        )
