"""Placing a request: ``Scheduler.Assign``, and placing it again after a worker failed it.

Assign goes through ``SchedulerCalls`` (``scheduler_wait``): an unreachable replica is skipped,
and while none answers the request waits, bounded, for one to come back. A placement after a
failure (``failover``) excludes the workers that failed the request and also waits while the
survivors are full.

Each try of Assign runs to completion even when the caller's deadline or a cancellation cuts
the wait for it short: a reservation committed after the router stopped waiting would
otherwise stay orphaned until its TTL. ``RequestState.assign_task`` holds the try in flight,
and the clean-up releases what it reserves, however late; a try that failed reserved nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from pdserve.errors import PdServeError
from pdserve.router.downstream import DeadlineExceededError, unary_call
from pdserve.router.housekeeping import Housekeeper
from pdserve.router.scheduler_wait import SchedulerCalls
from pdserve.router.state import RequestState
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

ASSIGN = "Scheduler.Assign"


class Placer:
    """Reserves workers for requests, and gives back what a failed attempt held."""

    def __init__(
        self, calls: SchedulerCalls, housekeeper: Housekeeper, *, assign_timeout_s: float
    ) -> None:
        self.calls = calls
        self.housekeeper = housekeeper
        self.assign_timeout_s = assign_timeout_s
        """Bound on each try of Assign, independent of the caller's deadline."""

    async def reassign(self, run: RequestState, mode: common_pb2.Mode) -> scheduler_pb2.Assignment:
        """Give the failed attempt's reservation back and place the request again, away
        from the workers that failed it; a decode worker alone once tokens went out."""
        if run.renewer is not None:
            run.renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run.renewer
            run.renewer = None
        if run.reservation_id:
            run.tasks.append(asyncio.create_task(self.housekeeper.release(run.reservation_id)))
            run.reservation_id = ""
        return await self.assign(run, mode, decode_only=bool(run.streamed))

    async def assign(
        self, run: RequestState, mode: common_pb2.Mode, *, decode_only: bool = False
    ) -> scheduler_pb2.Assignment:
        """Reserve workers for ``run`` (see the module docstring); keeps the reservation
        alive (``Housekeeper.renew_forever``) until the clean-up."""
        req = run.request
        run.clock.remaining(ASSIGN)
        # The router's own part ends here: validation and tokenization (by the caller, since
        # the request arrived), and the rollout arm; ``router.mode_decision`` is recorded once
        # the scheduler said which mode and why.
        asked_ns = time.time_ns()
        decides = not run.failed_workers  # a placement after a failure decides nothing new
        request = scheduler_pb2.AssignRequest(
            request_id=req.key.scoped_id,
            prompt_tokens=len(req.prompt_token_ids),
            max_tokens=req.params.max_tokens,
            mode=mode,
            tenant=req.tenant,
            exclude=run.failed_workers,
            decode_only=decode_only,
            prompt_token_ids=req.prompt_token_ids,
        )

        async def attempt(
            stub: scheduler_pb2_grpc.SchedulerStub,
        ) -> tuple[scheduler_pb2.Assignment, Any]:
            remaining = run.clock.remaining(ASSIGN)
            # Every try's stage starts where placement was asked for: a wait is part of it.
            with run.trace.handing_over(asked_ns):
                call = stub.Assign(request, timeout=self.assign_timeout_s)
            run.assign_task = asyncio.create_task(unary_call(ASSIGN, call), name="assign")
            try:
                answer = await asyncio.wait_for(asyncio.shield(run.assign_task), remaining)
            except TimeoutError:
                raise DeadlineExceededError(f"deadline exceeded during {ASSIGN}") from None
            except PdServeError:
                run.assign_task = None  # Assign itself failed: nothing was reserved
                raise
            return answer, call

        try:
            assignment, call = await self.calls.call(
                ASSIGN,
                attempt,
                deadline=run.clock.deadline,
                replacing=bool(run.failed_workers),
                span=run.trace.root,
                metrics=run.trace.metrics,
            )
        except PdServeError:
            if decides:
                run.trace.mode_decided(asked_ns, mode, req, None)
            raise
        if decides:
            run.trace.mode_decided(asked_ns, mode, req, assignment)
        run.reservation_id = assignment.reservation_id
        await run.trace.stage_ended(call)
        run.trace.placed()
        if assignment.ttl_s > 0:
            run.renewer = asyncio.create_task(
                self.housekeeper.renew_forever(assignment.reservation_id, assignment.ttl_s),
                name="renew",
            )
        return assignment
