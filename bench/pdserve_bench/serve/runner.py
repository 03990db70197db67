"""One point, open loop: every request is sent at its planned time, whatever is in flight.

Requests run as tasks of one ``asyncio.TaskGroup``; the point ends when the last has
finished (or hit ``request_timeout_s``). A conversation's turn ``k+1`` is the exception to the
schedule: it is sent at its planned time or when turn ``k`` has ended, whichever is later, and
its prompt is turn ``k``'s prompt, then the tokens the target answered, then its own new
tokens (what a chat client sends back: a failed turn adds only what arrived of its answer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve_bench.serve.records import RequestRecord, Status
from pdserve_bench.serve.targets import RejectedError, Target, TargetError
from pdserve_bench.serve.workload import PlannedRequest, PointPlan


@dataclass(slots=True)
class Counters:
    """Live counts of one point, for the progress bar."""

    total: int
    sent: int = 0
    finished: int = 0
    ok: int = 0
    rejected: int = 0
    errors: int = 0

    @property
    def in_flight(self) -> int:
        return self.sent - self.finished


class Conversations:
    """The history of every session of a point, and which turns have ended."""

    def __init__(self, requests: Sequence[PlannedRequest]) -> None:
        self._ended = {
            (r.session, r.turn): asyncio.Event() for r in requests if r.session is not None
        }
        self._history: dict[int, list[int]] = {}

    async def prompt(self, req: PlannedRequest) -> list[int]:
        """The prompt to send: for a later turn, once the previous turn has ended."""
        if req.session is None:
            return list(req.prompt)
        if req.turn > 1:
            await self._ended[(req.session, req.turn - 1)].wait()
        return [*self._history.get(req.session, ()), *req.prompt]

    def ended(self, req: PlannedRequest, prompt: list[int], answer: list[int]) -> None:
        if req.session is None:
            return
        self._history[req.session] = prompt + answer
        self._ended[(req.session, req.turn)].set()


async def run_point(
    target: Target,
    plan: PointPlan,
    *,
    request_timeout_s: float,
    on_change: Callable[[Counters], None] = lambda _c: None,
) -> list[RequestRecord]:
    """Send ``plan`` to ``target`` open loop; a record per request, in plan order."""
    records = [RequestRecord.planned(r) for r in plan.requests]
    conversations = Conversations(plan.requests)
    counters = Counters(len(records))
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async def one(req: PlannedRequest, rec: RequestRecord) -> None:
        prompt = await conversations.prompt(req)
        answer: list[int] = []
        rec.prompt_tokens = len(prompt)
        counters.sent += 1
        on_change(counters)
        rec.send_s = clock()
        try:
            async with asyncio.timeout(request_timeout_s):
                async for chunk in target.stream(prompt, req.output_tokens):
                    at = clock()
                    if chunk.tokens > 0:
                        rec.chunk_s.append(at)
                        rec.chunk_tokens.append(chunk.tokens)
                        answer += chunk.token_ids or ()
                    if chunk.usage_tokens is not None:
                        rec.reported_tokens = chunk.usage_tokens
                    if chunk.cached_tokens is not None:
                        rec.cached_tokens = chunk.cached_tokens
            rec.admitted = True
            if rec.output_tokens == req.output_tokens or (
                not target.features.exact_length and 0 < rec.output_tokens <= req.output_tokens
            ):
                rec.status, rec.error = Status.OK, ""
            else:
                rec.error = f"got {rec.output_tokens} of {req.output_tokens} tokens"
        except RejectedError as e:
            rec.status, rec.error = Status.REJECTED, str(e)
        except TargetError as e:
            rec.error = str(e)
            rec.admitted = e.admitted or bool(rec.chunk_s)
        except TimeoutError:
            # Held by the target (not refused) for the whole time allowed: admitted.
            rec.error = f"timed out after {request_timeout_s:g} s"
            rec.admitted = True
        finally:
            rec.end_s = clock()
            conversations.ended(req, prompt, answer)
            counters.finished += 1
            counters.ok += rec.status is Status.OK
            counters.rejected += rec.status is Status.REJECTED
            counters.errors += rec.status is Status.ERROR
            on_change(counters)

    async with asyncio.TaskGroup() as tasks:
        for req, rec in zip(plan.requests, records, strict=True):
            wait = req.arrival_s - clock()
            if wait > 0:
                await asyncio.sleep(wait)  # the schedule itself: open-loop arrivals
            tasks.create_task(one(req, rec))
    return records
