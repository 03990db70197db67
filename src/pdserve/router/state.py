"""The state of one request in the router: its clock, everything it has opened, and the
chunks it streams back."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.engine.outputs import FinishReason
from pdserve.logprobs import PromptLogprobs, TopLogprobs
from pdserve.router.output import RouteChunk, RouteUsage
from pdserve.router.request import RouteRequest
from pdserve.router.text import ResponseText
from pdserve.router.trace import Clock, RequestTrace
from pdserve.v1 import common_pb2, scheduler_pb2


@dataclass(slots=True)
class RequestState:
    """Everything one request has opened, so that the clean-up can close it."""

    request: RouteRequest
    clock: Clock
    text: ResponseText
    trace: RequestTrace
    """The request's stages and timing."""
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
    completion_tokens: int = 0
    streamed: list[int] = field(default_factory=list)
    """Every token streamed to the caller so far (a migration resumes after them)."""
    serving: str = ""
    """Id of the worker the current call runs on (blamed if it fails)."""
    failed_workers: list[str] = field(default_factory=list)
    """Workers that failed this request; a new placement excludes them."""
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    """Why the request finished, once its last chunk is made."""
    finished_stream: Any = None
    """The worker stream that sent its last chunk: the clean-up reads it to its end."""
    wound_up: bool = False
    """The stream's end and the release already started with the last chunk
    (``Housekeeper.wind_up``)."""

    def chunk(
        self,
        tokens: list[int],
        logprobs: list[float],
        finish: FinishReason | None,
        tops: list[TopLogprobs] | None = None,
        prompt: PromptLogprobs | None = None,
    ) -> RouteChunk:
        """The chunk streaming new tokens (with their alternatives ``tops``, if asked, and the
        prompt's logprobs on the first); cut after a stop string, final when ``finish`` is set
        (then with usage and timing)."""
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
            top_logprobs=(tops or [])[:kept],
            prompt_logprobs=prompt,
        )
        if chunk.token_ids:
            self.trace.token_sent()
        if finish is not None:
            self.finish_reason = finish
            chunk.timing = self.trace.finished()
            chunk.usage = RouteUsage(
                prompt_tokens=len(self.request.prompt_token_ids),
                completion_tokens=self.completion_tokens,
                cached_tokens=self.cached_tokens,
            )
        return chunk
