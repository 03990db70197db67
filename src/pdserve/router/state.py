"""The state of one request in the router: its clock, everything it has opened, and the
chunks it streams back."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace

from pdserve.engine.outputs import FinishReason
from pdserve.router.downstream import DeadlineExceededError
from pdserve.router.output import RouteChunk, RouteTiming, RouteUsage
from pdserve.router.request import RouteRequest
from pdserve.router.text import ResponseText
from pdserve.v1 import common_pb2, scheduler_pb2


class Clock:
    """The request's start time and the caller's deadline, on the monotonic clock."""

    def __init__(self, timeout_s: float | None) -> None:
        self.start = time.monotonic()
        self.deadline = None if timeout_s is None else self.start + timeout_s

    def elapsed_ms(self) -> float:
        return (time.monotonic() - self.start) * 1000.0

    def remaining(self, step: str) -> float | None:
        """Seconds left for the call named ``step``; DeadlineExceededError if none are."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(f"deadline exceeded before {step}")
        return left


@dataclass(slots=True)
class RequestState:
    """Everything one request has opened, so that the clean-up can close it."""

    request: RouteRequest
    clock: Clock
    text: ResponseText
    reservation_id: str = ""
    calls: list[grpc.aio.Call] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    """Background calls the clean-up waits for (the prefill-only release)."""
    renewer: asyncio.Task[None] | None = None
    """Keeps the reservation alive; cancelled by the clean-up."""
    assign_task: asyncio.Task[scheduler_pb2.Assignment] | None = None
    """The Assign call; never cancelled, so that a late reservation can still be released."""
    prefill_call: grpc.aio.UnaryUnaryCall[Any, Any] | None = None
    kv: common_pb2.KVHandle | None = None
    kv_consumed: bool = False
    """True once a decode worker has streamed from the KV (it then owns the payload)."""
    timing: RouteTiming = field(default_factory=RouteTiming)
    completion_tokens: int = 0
    streamed: list[int] = field(default_factory=list)
    """Every token streamed to the caller so far (a migration resumes after them)."""
    serving: str = ""
    """Id of the worker the current call runs on (blamed if it fails)."""
    failed_workers: list[str] = field(default_factory=list)
    """Workers that failed this request; a new placement excludes them."""
    cached_tokens: int = 0
    first_sent: bool = False
    root: trace.Span | None = None
    """``router.request``: the parent of every stage, handed to each call (tracing)."""
    arm: str = ""
    """The rollout arm the request was sent in ("" when no split is set)."""
    stage_end_ns: int | None = None
    """Unix ns where the last stage so far ended, handed to the next call (tracing)."""
    finished_stream: Any = None
    """The worker stream that sent its last chunk: the clean-up reads it to its end."""
    wound_up: bool = False
    """The stream's end and the release already started with the last chunk
    (``Housekeeper.wind_up``)."""

    def chunk(
        self, tokens: list[int], logprobs: list[float], finish: FinishReason | None
    ) -> RouteChunk:
        """The chunk streaming new tokens; cut after a stop string, final when ``finish`` is
        set (then with usage and timing)."""
        kept = 0
        for token in tokens:
            kept += 1
            if self.text.add(token):
                # The text completed a stop string: whatever the worker sent after it is dropped.
                finish = finish if finish is not None else FinishReason.STOP
                break
        self.completion_tokens += kept
        self.streamed += tokens[:kept]
        chunk = RouteChunk(
            self.request.request_id,
            token_ids=tokens[:kept],
            logprobs=logprobs[:kept],
            text=self.text.take(final=finish is not None),
            finish_reason=finish,
        )
        if not self.first_sent and chunk.token_ids:
            self.first_sent = True
            self.timing.ttft_ms = self.clock.elapsed_ms()
        if finish is not None:
            self.timing.e2e_ms = self.clock.elapsed_ms()
            chunk.timing = self.timing
            chunk.usage = RouteUsage(
                prompt_tokens=len(self.request.prompt_token_ids),
                completion_tokens=self.completion_tokens,
                cached_tokens=self.cached_tokens,
            )
        return chunk
