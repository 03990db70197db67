"""The requests a tensorrt-llm backend has in TensorRT-LLM: their bookkeeping (the backend's
capacity figures) and the translation of each one's cumulative outputs into pdserve's.

A request counts as waiting, with its prompt tokens queued, until its first output comes;
then it runs until it finishes or its stream is closed (which aborts it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.backends.tensorrt_llm_api import finish_reason, new_logprobs
from pdserve.engine.outputs import FinishReason, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import DuplicateRequestError, HandedBackError, WorkerUnavailableError
from pdserve.timing import RequestTiming


@dataclass(slots=True)
class _Live:
    result: Any
    """TensorRT-LLM's ``RequestOutput`` of the request (``abort()``)."""
    prompt_tokens: int
    reservation_id: str
    started: bool = False
    """An output came: it is computing, no longer queued."""
    handed_back: str | None = None
    """Why the request was handed back (``LiveRequests.hand_back``); its stream raises it."""


@dataclass(frozen=True, slots=True)
class Load:
    """What the backend's requests add up to."""

    queued_tokens: int
    running: int
    waiting: int
    tags: tuple[str, ...]
    failed: int
    """Requests that ended in an error of TensorRT-LLM so far."""


class LiveRequests:
    """The requests in TensorRT-LLM, by pdserve request id."""

    def __init__(self) -> None:
        self._live: dict[str, _Live] = {}
        self.closed = False
        self.failed = 0

    def load(self) -> Load:
        """Readable from any thread (the metrics server's): one copy of the table is taken
        at once, under the interpreter lock."""
        lives = list(self._live.values())
        queued = [live for live in lives if not live.started]
        return Load(
            queued_tokens=sum(live.prompt_tokens for live in queued),
            running=len(lives) - len(queued),
            waiting=len(queued),
            tags=tuple(live.reservation_id for live in lives if live.reservation_id),
            failed=self.failed,
        )

    def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            live.result.abort()

    def hand_back(self, why: str) -> None:
        """Abort every request; each stream ends in ``HandedBackError(why)``, so that
        its reader continues it elsewhere (``EngineBackend.hand_back``)."""
        for live in list(self._live.values()):
            live.handed_back = why
            live.result.abort()

    def close(self) -> None:
        """Abort every request; refuse new ones."""
        self.closed = True
        for live in list(self._live.values()):
            live.result.abort()
        self._live.clear()

    async def stream(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        submit: Callable[[], Any],
        *,
        reservation_id: str = "",
        timing: RequestTiming | None = None,
        skip: int = 0,
        on_finish: Callable[[Any], None] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Call ``submit`` (it returns TensorRT-LLM's ``RequestOutput``) at the first
        ``__anext__`` and yield pdserve outputs of its cumulative ones: the tokens past
        ``skip`` (a generation-only request's first token is the context phase's), the last
        one finished. ``on_finish`` receives TensorRT-LLM's finished ``RequestOutput``.
        Closing the stream before its end aborts the request."""
        if self.closed:
            raise WorkerUnavailableError("the tensorrt-llm backend is closed")
        if request_id in self._live:
            raise DuplicateRequestError(f"request {request_id!r} is already in flight")
        timing = timing if timing is not None else RequestTiming()
        result = submit()
        live = self._live[request_id] = _Live(result, len(prompt_ids), reservation_id)
        timing.first_step_start = time.perf_counter()  # TensorRT-LLM's queue counts as compute
        emitted, finished = skip, False
        try:
            async for res in result:
                if live.handed_back is not None:
                    break
                out = res.outputs[0]
                ids = list(out.token_ids)
                timing.last_output = time.perf_counter()
                if timing.first_output is None:
                    timing.first_output = timing.last_output
                live.started = True
                finished = bool(res.finished)
                reason = finish_reason(out.finish_reason, request_id) if finished else None
                if finished and reason is None:  # finished without a word: which limit hit?
                    at_limit = len(ids) >= params.max_tokens
                    reason = FinishReason.LENGTH if at_limit else FinishReason.STOP
                if finished and on_finish is not None:
                    on_finish(res)
                if len(ids) <= emitted and not finished:
                    continue
                output = RequestOutput(
                    request_id,
                    ids[emitted:],
                    new_logprobs(out.logprobs, ids, emitted),
                    finished=finished,
                    finish_reason=reason,
                    num_prompt_tokens=len(prompt_ids),
                    num_cached_tokens=int(getattr(res, "cached_tokens", 0) or 0),
                )
                emitted = max(emitted, len(ids))
                yield output
                if finished:
                    return
            if live.handed_back is not None:
                raise HandedBackError(live.handed_back)
            raise WorkerUnavailableError(f"tensorrt-llm ended {request_id!r} unfinished")
        except Exception:
            if live.handed_back is None:
                self.failed += 1  # counted for the metrics; the caller gets the error
            raise
        finally:
            self._live.pop(request_id, None)
            if not finished:
                result.abort()


async def finished_at_first(
    request_id: str, prompt_tokens: int
) -> AsyncGenerator[RequestOutput, None]:
    """The stream of a request whose first token was its last (``max_tokens`` 1)."""
    yield RequestOutput(
        request_id,
        [],
        [],
        finished=True,
        finish_reason=FinishReason.LENGTH,
        num_prompt_tokens=prompt_tokens,
    )
