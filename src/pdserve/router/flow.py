"""The life of one request in the router.

Disaggregated mode::

    Scheduler.Assign --> Prefill.Prefill --> first chunk to the client at once
                                         \\-> Scheduler.Release(prefill_only) (in the background)
                     --> Decode.Decode(KV handle) --> chunks --> last chunk (usage, timing)

Colocated mode: ``Scheduler.Assign`` picks one mixed worker and ``Mixed.Generate`` streams.

The mode asked of the scheduler is the request's rollout arm when a split is set
(``rollout``), else the router's configured mode; in ``conditional`` mode (the default) the
scheduler decides per request. The prompt's token ids go along, for KV-aware placement
(``placing``). While no scheduler replica answers (one restarting), the request waits for one,
bounded by ``--scheduler-wait-s`` and its deadline (``scheduler_wait``).

Whatever happens (success, error, client cancel, deadline) the clean-up runs: downstream calls
still open are cancelled (a cancelled Decode frees its KV blocks on the worker), a KV payload
that no decode worker has picked up is deleted from its store, and the reservation is released.
The clean-up runs shielded from a second cancellation and is tracked, so ``close()`` can wait
for it. When the worker sends its last chunk, the read of the stream's end starts at once,
while that chunk is on its way to the caller, and the release of the reservation runs in the
background (tracked, in a trace of its own): the caller's call ends right after its last chunk,
without waiting for the scheduler. Every downstream call gets the caller's remaining deadline.

A worker that fails a request (UNAVAILABLE) does not fail it for the caller: before any token
went out the request is placed again elsewhere, after that it migrates to another decode
worker, which resumes after the tokens already streamed (``failover``; bounded by
``FlowConfig.prefill_attempts`` and ``migration_limit``). Such a placement waits, as long as
for a scheduler, while the surviving workers are full.

Tracing and timing (``observed``) are the request's ``RequestTrace`` (``trace``): it records
``router.mode_decision`` (with the scheduler's reasons), names the mode on ``router.request``
and hands it, with the last stage's end, to every call (``handover``), so the stages tile the
request; each worker's answer adds to its ``Timing``. A stream that sent its last chunk is read
to its end, not cancelled.

While traffic capture is on (``capture``), a request it admits as it enters leaves a record
of its shape when it ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from grpc.aio import AioRpcError

from pdserve.convert import (
    finish_reason_from_proto,
    mode_from_name,
    prefill_timing_from_proto,
    sampling_to_proto,
    timing_from_proto,
)
from pdserve.convert.logprobs import chunk_logprobs, prefill_logprobs
from pdserve.errors import PdServeError
from pdserve.router.capture import Capture
from pdserve.router.channels import ChannelPool
from pdserve.router.downstream import (
    DownstreamError,
    downstream_error,
    unary_call,
)
from pdserve.router.failover import Attempts, migrated_request
from pdserve.router.housekeeping import Housekeeper
from pdserve.router.inflight import InFlight
from pdserve.router.output import RouteChunk
from pdserve.router.placing import Placer
from pdserve.router.request import RouteRequest
from pdserve.router.scheduler_wait import SchedulerCalls, WaitPolicy
from pdserve.router.schedulers import SchedulerReplicas
from pdserve.router.state import RequestState
from pdserve.router.telemetry import ObservedRequest
from pdserve.router.text import ResponseText
from pdserve.router.trace import Clock, RequestTrace
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    scheduler_pb2,
)

logger = logging.getLogger(__name__)


class Arms(Protocol):
    """Chooses a request's rollout arm (``rollout.RolloutFollower``)."""

    def arm(self, request_id: str, tenant: str) -> str | None:
        """The arm (a mode name), or None to use the configured mode."""
        ...


@dataclass(frozen=True, slots=True)
class FlowConfig:
    """How the router places and cleans up requests."""

    mode: common_pb2.Mode = common_pb2.MODE_CONDITIONAL
    """``pdserve.v1.Mode`` asked of the scheduler when no rollout arm applies."""
    cleanup_timeout_s: float = 5.0
    """Bound on each clean-up call (Release, KV delete); a stuck call must not pin the request."""
    assign_timeout_s: float = 10.0
    """Bound on each try of Scheduler.Assign, independent of the caller's deadline
    (``placing``)."""
    renew_fraction: float = 0.5
    """Renew a reservation after this fraction of its TTL (long decodes outlive the TTL)."""
    prefill_attempts: int = 3
    """Tries in all of a request whose worker fails before any token went out."""
    migration_limit: int = 2
    """Migrations at most of a request whose stream breaks mid-way; 0: none."""
    scheduler_wait: WaitPolicy = field(default_factory=WaitPolicy)
    """How long a call waits for a scheduler (restarting, or full during a failover)."""

    def __post_init__(self) -> None:
        Attempts(self.prefill_attempts, self.migration_limit)  # validates them


class RequestFlow:
    """Serves requests end to end against the scheduler and the workers it assigns."""

    def __init__(
        self,
        *,
        scheduler_address: str | Sequence[str],
        tokenizer: Tokenizer,
        channels: ChannelPool | None = None,
        config: FlowConfig | None = None,
        arms: Arms | None = None,
        capture: Capture | None = None,
    ) -> None:
        self.arms = arms
        self.capture = capture
        self.tokenizer = tokenizer
        # Not ``channels or ...``: a pool with no channel yet is falsy (it has a length).
        self.channels = channels if channels is not None else ChannelPool()
        self.config = config or FlowConfig()
        self.scheduler = SchedulerCalls(
            SchedulerReplicas(scheduler_address, self.channels), self.config.scheduler_wait
        )
        """Every scheduler call goes to the next replica, and waits while none answers
        (``router.scheduler_wait``)."""
        self.housekeeper = Housekeeper(
            self.channels,
            self.scheduler,
            timeout_s=self.config.cleanup_timeout_s,
            renew_fraction=self.config.renew_fraction,
        )
        self.placer = Placer(
            self.scheduler, self.housekeeper, assign_timeout_s=self.config.assign_timeout_s
        )
        self._cleanups: set[asyncio.Task[None]] = set()
        self.in_flight = InFlight()
        """The keys of the requests in flight: a tenant's id is refused while it runs."""

    async def generate(
        self,
        request: RouteRequest,
        *,
        timeout_s: float | None = None,
        observed: ObservedRequest | None = None,
    ) -> AsyncGenerator[RouteChunk, None]:
        """Stream the response; the first chunk carries the first token, the last one
        ``finish_reason``, usage and timing. ``timeout_s`` is the caller's remaining deadline;
        ``observed`` the request's root span and arrival (see the module docstring)."""
        params = request.params
        clock = Clock(timeout_s)
        text = ResponseText(
            self.tokenizer,
            params.stop,
            skip_special_tokens=request.skip_special_tokens,
            min_tokens=params.min_tokens,
        )
        run = RequestState(request, clock, text, RequestTrace.of(clock, observed))
        claim = self.in_flight.claim(request.key)  # ALREADY_EXISTS: this tenant runs the id
        ticket = self.capture.admit(observed) if self.capture is not None else None
        failed: type[BaseException] | None = None
        try:
            arm = self.arms.arm(request.request_id, request.tenant) if self.arms else None
            run.trace.arm = arm or ""
            if observed is not None:
                observed.arm = run.trace.arm
            mode = mode_from_name(arm) if arm else self.config.mode
            assignment = await self.placer.assign(run, mode)
            run.trace.serving_mode(assignment.mode)  # the scheduler has the last word
            stream = self._serve(run, assignment)
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    if chunk.finished:
                        claim.release()  # the caller may reuse the id once it has this chunk
                    yield chunk
        except BaseException as err:
            failed = type(err)
            raise
        finally:
            claim.release()
            if ticket is not None:
                ticket.finished(run, failed)
            task = self._track(self.housekeeper.clean_up(run, self._track))
            # Shielded: a second cancellation (server shutdown) must not cut the clean-up short;
            # the task stays tracked and close() waits for it.
            await asyncio.shield(task)

    async def collect(
        self,
        request: RouteRequest,
        *,
        timeout_s: float | None = None,
        observed: ObservedRequest | None = None,
    ) -> RouteChunk:
        """The whole response as one chunk (for unary calls); ``observed`` sees each piece
        as it arrives."""
        total = RouteChunk(request.request_id)
        stream = self.generate(request, timeout_s=timeout_s, observed=observed)
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                if observed is not None:
                    observed.chunk(chunk)
                total.token_ids += chunk.token_ids
                total.logprobs += chunk.logprobs
                total.top_logprobs += chunk.top_logprobs
                total.prompt_logprobs = total.prompt_logprobs or chunk.prompt_logprobs
                total.text += chunk.text
                total.finish_reason = chunk.finish_reason
                total.usage = chunk.usage
                total.timing = chunk.timing
        return total

    async def close(self) -> None:
        """Wait for clean-ups still running, then close the channels."""
        while self._cleanups:  # a clean-up may start another (a late Assign's release)
            await asyncio.gather(*list(self._cleanups))
        await self.channels.close()

    # -- steps ---------------------------------------------------------------------------------

    async def _serve(
        self, run: RequestState, assignment: scheduler_pb2.Assignment
    ) -> AsyncGenerator[RouteChunk, None]:
        """Run the request on ``assignment``; when a worker fails it, place it again and go
        on: from the start while no token went out, else as a migration (``failover``)."""
        attempts = Attempts(self.config.prefill_attempts, self.config.migration_limit)
        while True:
            if run.streamed:
                stream = self._migrated(run, assignment)
            elif assignment.mode == common_pb2.MODE_COLOCATED:
                stream = self._colocated(run, assignment)
            else:
                stream = self._disaggregated(run, assignment)
            try:
                async with contextlib.aclosing(stream):
                    async for chunk in stream:
                        yield chunk
                return
            except PdServeError as err:
                if not attempts.another(err, migrating=bool(run.streamed)):
                    raise
                run.failed_workers.append(run.serving)
                logger.warning(
                    "request %s: %s; %s", run.request.request_id, err,
                    f"migrating after {len(run.streamed)} tokens" if run.streamed
                    else "placing it again",
                )  # fmt: skip
                assignment = await self.placer.reassign(run, assignment.mode)

    async def _disaggregated(
        self, run: RequestState, assignment: scheduler_pb2.Assignment
    ) -> AsyncGenerator[RouteChunk, None]:
        req = run.request
        worker = assignment.prefill
        step = f"Prefill on {worker.id} ({worker.address})"
        run.serving = worker.id
        prefill = prefill_pb2_grpc.PrefillStub(self.channels.get(worker.address))
        with run.trace.handing_over():
            call = prefill.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=req.key.scoped_id,
                    prompt_token_ids=req.prompt_token_ids,
                    sampling=sampling_to_proto(req.params),
                    tenant=req.tenant,
                    reservation_id=run.reservation_id,
                    # The decode worker, so that the prefill worker can choose the KV
                    # transport (same host: shm) and stream straight to it (direct).
                    decode_address=assignment.decode.address,
                    decode_host=assignment.decode.host,
                ),
                timeout=run.clock.remaining(step),
            )
        run.calls.append(call)
        run.prefill_call = call
        resp: prefill_pb2.PrefillResponse = await unary_call(step, call)
        await run.trace.stage_ended(call)
        if resp.HasField("kv"):
            run.kv = resp.kv
        run.trace.prefilled(prefill_timing_from_proto(resp))
        run.cached_tokens = resp.num_cached_tokens

        finish = finish_reason_from_proto(resp.finish_reason, field="PrefillResponse.finish_reason")
        tops, prompt = prefill_logprobs(resp)
        first = run.chunk([resp.first_token_id], [resp.first_logprob], finish, tops, prompt)
        yield first
        if first.finished:
            return
        if run.kv is None:
            raise DownstreamError(
                step, grpc.StatusCode.INTERNAL, "no KV handle and no finish reason"
            )
        # After the first chunk, not before: building and starting the call would delay the
        # first token by as much as the decode side could gain.
        step, stream = self._start_decode(run, assignment.decode, resp)

        def absorb(last: decode_pb2.DecodeChunk) -> None:
            run.trace.decoded(timing_from_proto(last.timing))

        async for chunk in self._relay(run, step, stream, absorb):
            yield chunk

    def _start_decode(
        self,
        run: RequestState,
        worker: scheduler_pb2.WorkerRef,
        prefilled: prefill_pb2.PrefillResponse,
    ) -> tuple[str, Any]:
        """Start the Decode call (and the release of the prefill's share); the step's name
        and the response stream."""
        req = run.request
        # The prefill worker is done with this request: give its share back right away.
        run.tasks.append(
            asyncio.create_task(self.housekeeper.release(run.reservation_id, prefill_only=True))
        )
        step = f"Decode on {worker.id} ({worker.address})"
        run.serving = worker.id
        decode = decode_pb2_grpc.DecodeStub(self.channels.get(worker.address))
        with run.trace.handing_over():
            stream = decode.Decode(
                decode_pb2.DecodeRequest(
                    request_id=req.key.scoped_id,
                    prompt_token_ids=req.prompt_token_ids,
                    first_token_id=prefilled.first_token_id,
                    first_logprob=prefilled.first_logprob,
                    sampling=sampling_to_proto(req.params),
                    kv=run.kv,
                    reservation_id=run.reservation_id,
                    tenant=req.tenant,
                ),
                timeout=run.clock.remaining(step),
            )
        run.calls.append(stream)
        return step, stream

    async def _colocated(
        self, run: RequestState, assignment: scheduler_pb2.Assignment
    ) -> AsyncGenerator[RouteChunk, None]:
        req = run.request
        worker = assignment.prefill
        step = f"Mixed.Generate on {worker.id} ({worker.address})"
        run.serving = worker.id
        mixed = decode_pb2_grpc.MixedStub(self.channels.get(worker.address))
        with run.trace.handing_over():
            stream = mixed.Generate(
                decode_pb2.ColocatedRequest(
                    request_id=req.key.scoped_id,
                    prompt_token_ids=req.prompt_token_ids,
                    sampling=sampling_to_proto(req.params),
                    tenant=req.tenant,
                    reservation_id=run.reservation_id,
                ),
                timeout=run.clock.remaining(step),
            )
        run.calls.append(stream)

        def absorb(last: decode_pb2.DecodeChunk) -> None:
            run.trace.generated(timing_from_proto(last.timing))
            run.cached_tokens = last.num_cached_tokens

        async for chunk in self._relay(run, step, stream, absorb):
            yield chunk

    async def _migrated(
        self, run: RequestState, assignment: scheduler_pb2.Assignment
    ) -> AsyncGenerator[RouteChunk, None]:
        """Continue after ``run.streamed`` on the assignment's decode worker, which prefills
        the prompt and those tokens itself (``failover``)."""
        worker = assignment.decode
        step = f"Decode (migrated) on {worker.id} ({worker.address})"
        run.serving = worker.id
        request = migrated_request(
            run.request,
            run.streamed,
            reservation_id=run.reservation_id,
            fingerprint=run.kv.model_fingerprint if run.kv is not None else "",
            reason=f"migrated from {run.failed_workers[-1]} after {len(run.streamed)} tokens",
        )
        decode = decode_pb2_grpc.DecodeStub(self.channels.get(worker.address))
        with run.trace.handing_over():
            stream = decode.Decode(request, timeout=run.clock.remaining(step))
        run.calls.append(stream)

        def absorb(last: decode_pb2.DecodeChunk) -> None:
            run.trace.decoded(timing_from_proto(last.timing))

        async for chunk in self._relay(run, step, stream, absorb):
            yield chunk

    async def _relay(
        self,
        run: RequestState,
        step: str,
        stream: Any,
        absorb: Callable[[decode_pb2.DecodeChunk], None],
    ) -> AsyncGenerator[RouteChunk, None]:
        """Forward a DecodeChunk stream until its last chunk (or a stop string seen here)."""
        try:
            async for msg in stream:
                run.kv_consumed = True
                finish = finish_reason_from_proto(
                    msg.finish_reason, field="DecodeChunk.finish_reason"
                )
                if finish is not None:
                    absorb(msg)
                    run.finished_stream = stream  # the worker is done: read, don't cancel
                    self.housekeeper.wind_up(run, stream, self._track)
                tops, prompt = chunk_logprobs(msg)
                chunk = run.chunk(list(msg.token_ids), list(msg.logprobs), finish, tops, prompt)
                if chunk.token_ids or chunk.text or chunk.finished:
                    yield chunk
                if chunk.finished:
                    return
        except AioRpcError as err:
            raise downstream_error(step, err) from err
        raise DownstreamError(
            step, grpc.StatusCode.UNAVAILABLE, "stream ended without a finish reason"
        )

    def _track(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task
