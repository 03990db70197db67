"""What was observed of one request: its timeline, chunk by chunk, and how it ended.

Times are seconds from the start of the request's point, all read from one monotonic clock
(``time.perf_counter``) in the benchmark's process, whatever the target.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pdserve_bench.serve.workload import PlannedRequest


class Status(StrEnum):
    OK = "ok"
    """Every asked-for token arrived."""
    REJECTED = "rejected"
    """Refused for load before any work (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""
    ERROR = "error"
    """Anything else: an error status, a timeout, a stream cut short."""


@dataclass(slots=True)
class RequestRecord:
    """One request: planned, sent, streamed, ended."""

    index: int
    kind: str
    warmup: bool
    scheduled_s: float
    max_tokens: int
    session: int | None = None
    turn: int = 0
    prompt_tokens: int = 0
    """As sent (a conversation's turn carries its history)."""
    send_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    """Arrival time of every streamed chunk that carried tokens."""
    chunk_tokens: list[int] = field(default_factory=list)
    """Tokens in each of those chunks."""
    end_s: float | None = None
    """When the stream ended (its last message, or the error)."""
    status: Status = Status.ERROR
    error: str = "not finished"
    admitted: bool = False
    """The target accepted the request (it was not refused, and the target was reached):
    an admitted request that fails is what SLO-aware admission must avoid."""
    reported_tokens: int | None = None
    """Output tokens by the target's own count (usage), where it gives one."""
    cached_tokens: int | None = None
    """Prompt tokens the target says it served from its prefix cache, where it does."""

    @classmethod
    def planned(cls, req: PlannedRequest) -> RequestRecord:
        return cls(
            req.index, req.kind, req.warmup, req.arrival_s, req.output_tokens,
            req.session, req.turn, prompt_tokens=len(req.prompt),
        )  # fmt: skip

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> float | None:
        if self.send_s is None or not self.chunk_s:
            return None
        return self.chunk_s[0] - self.send_s

    @property
    def e2e_s(self) -> float | None:
        if self.send_s is None or self.end_s is None:
            return None
        return self.end_s - self.send_s

    @property
    def gaps_s(self) -> list[float]:
        """Inter-chunk gaps: between consecutive token-carrying chunks."""
        return [b - a for a, b in itertools.pairwise(self.chunk_s)]

    @property
    def tpot_s(self) -> float | None:
        """``(e2e - ttft) / (output_tokens - 1)``; None below two tokens."""
        ttft, e2e, n = self.ttft_s, self.e2e_s, self.output_tokens
        if ttft is None or e2e is None or n < 2:
            return None
        return (e2e - ttft) / (n - 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "warmup": self.warmup,
            "session": self.session,
            "turn": self.turn,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "scheduled_s": self.scheduled_s,
            "send_s": self.send_s,
            "chunk_s": [round(t, 6) for t in self.chunk_s],  # microseconds: a smaller file
            "chunk_tokens": self.chunk_tokens,
            "end_s": self.end_s,
            "status": self.status.value,
            "error": self.error,
            "admitted": self.admitted,
            "output_tokens": self.output_tokens,
            "reported_tokens": self.reported_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "tpot_s": self.tpot_s,
        }
