"""The calls that tidy up after a request: releases, renewals, KV deletions, stream ends;
``Housekeeper.clean_up`` runs them for a request that ended, however it ended, and
``Housekeeper.wind_up`` starts them early for one whose worker sent its last chunk.

Each is best effort by design: a failure is logged and the state it concerns expires on its
own (a reservation by its TTL, a KV payload by its lease), so it never fails a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from grpc.aio import AioRpcError
from opentelemetry import trace

from pdserve.errors import PdServeError
from pdserve.kvstore.mooncake.address import is_mooncake
from pdserve.request_key import RequestKey
from pdserve.router.channels import ChannelPool
from pdserve.router.downstream import late_kv, unary_call
from pdserve.router.scheduler_wait import SchedulerCalls
from pdserve.router.state import RequestState
from pdserve.router.telemetry import detached
from pdserve.telemetry.spans import ROUTER_RELEASE
from pdserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

logger = logging.getLogger(__name__)


Track = Callable[[Coroutine[Any, Any, None]], Any]
"""Starts a background clean-up that outlives the request (its owner waits for it on close)."""


class Housekeeper:
    """Talks to the scheduler and the KV stores on behalf of finished requests."""

    def __init__(
        self,
        channels: ChannelPool,
        scheduler: SchedulerCalls,
        *,
        timeout_s: float = 5.0,
        renew_fraction: float = 0.5,
    ) -> None:
        self.channels = channels
        self.scheduler = scheduler
        """Release and Renew go to any replica, and wait while none answers (a scheduler
        restarting): one lost holds the capacity until the reservation's TTL."""
        self.timeout_s = timeout_s
        """Bound on each call; a stuck call must not pin the request."""
        self.renew_fraction = renew_fraction
        """Renew a reservation after this fraction of its TTL."""

    async def release_when_assigned(
        self, request_id: str, assign: asyncio.Task[scheduler_pb2.Assignment]
    ) -> None:
        """Wait for an Assign the caller stopped waiting for; release what it reserved."""
        try:
            reservation_id = (await assign).reservation_id
        except PdServeError as err:
            logger.info("request %s: Assign ended after the caller left: %s", request_id, err)
            return
        await self.release(reservation_id)

    async def release(self, reservation_id: str, *, prefill_only: bool = False) -> None:
        """Scheduler.Release (only the prefill share with ``prefill_only``), waiting for a
        scheduler while none answers (``scheduler_wait``)."""
        step = "Scheduler.Release"
        request = scheduler_pb2.ReleaseRequest(
            reservation_id=reservation_id, prefill_only=prefill_only
        )

        async def attempt(stub: scheduler_pb2_grpc.SchedulerStub) -> None:
            await unary_call(step, stub.Release(request, timeout=self.timeout_s))

        try:
            await self.scheduler.call(step, attempt, span=trace.get_current_span())
        except PdServeError as err:
            # The reservation expires by its TTL; the request itself is unaffected.
            logger.warning(
                "Release of reservation %s failed (%s); it expires by its TTL", reservation_id, err
            )

    async def renew_forever(self, reservation_id: str, ttl_s: float) -> None:
        """Renew the reservation before each TTL runs out, until cancelled or it is gone."""
        step = "Scheduler.Renew"
        request = scheduler_pb2.RenewRequest(reservation_id=reservation_id)

        async def attempt(stub: scheduler_pb2_grpc.SchedulerStub) -> scheduler_pb2.RenewResponse:
            reply: scheduler_pb2.RenewResponse = await unary_call(
                step, stub.Renew(request, timeout=self.timeout_s)
            )
            return reply

        while True:
            # A timer, not synchronisation: renew well before the reservation would expire.
            await asyncio.sleep(max(0.05, ttl_s * self.renew_fraction))
            try:
                resp = await self.scheduler.call(step, attempt)
            except PdServeError as err:
                if err.grpc_code == "NOT_FOUND":
                    logger.warning("reservation %s expired before it was renewed", reservation_id)
                    return
                logger.warning("Renew of %s failed: %s", reservation_id, err)
                continue
            ttl_s = resp.ttl_s

    async def delete_kv(self, kv: common_pb2.KVHandle) -> None:
        """Delete a KV payload nobody picked up where its handle names it (absent is fine): a
        store entry (``KVStore.Delete``), a hand-off pushed into a decode worker
        (``Decode.Drop``)."""
        where = kv.WhichOneof("location")
        request = kvstore_pb2.DeleteRequest()
        if where == "store":
            address = kv.store.address
            if is_mooncake(address):
                # A Mooncake Store's object: its reader deletes it, or the prefill worker's
                # discard; one nobody reads stays until Mooncake evicts it (docs/kv-transfer.md).
                return
            request.key = kv.store.key
            call = kvstore_pb2_grpc.KVStoreStub(self.channels.get(address)).Delete
        elif where == "direct":
            address = kv.direct.address
            request.key = kv.direct.key
            call = decode_pb2_grpc.DecodeStub(self.channels.get(address)).Drop
        else:
            return  # shm segments and native state are owned by the workers
        try:
            await call(request, timeout=self.timeout_s)
        except AioRpcError as err:
            if err.code() is not grpc.StatusCode.NOT_FOUND:
                logger.warning(
                    "KV delete of %s at %s failed: %s", request.key, address, err.details()
                )

    async def drain(self, stream: Any) -> None:
        """Read a worker stream that sent its last chunk to its end (its status), so that the
        worker's handler and the CLIENT span end normally; cancel it if that takes long."""
        try:
            async with asyncio.timeout(self.timeout_s):
                async for _ in stream:
                    pass  # nothing follows a last chunk
        except (TimeoutError, AioRpcError) as err:
            logger.debug("stream after its last chunk: %s", err)
            stream.cancel()

    def wind_up(self, run: RequestState, stream: Any, track: Track) -> None:
        """The worker sent its last chunk: start the end of the request now, while the last
        chunk goes out to the caller. The clean-up waits for the stream's end (its CLIENT
        span must end inside the caller's call), not for the release of the reservation: that
        runs through ``track`` (its owner waits for it on close), in a trace of its own, so
        the caller's call ends without waiting for the scheduler."""
        if run.renewer is not None:
            run.renewer.cancel()  # nothing left to renew; the clean-up awaits its end
        run.tasks.append(asyncio.create_task(self.drain(stream)))
        track(self.release_after(run.request.key, run.reservation_id, run.trace.root))
        run.wound_up = True

    async def release_after(
        self, key: RequestKey, reservation_id: str, root: trace.Span | None
    ) -> None:
        """Release the reservation of a request whose call may have ended: under a
        ``router.release`` span linked to the request's ``router.request`` (``root``)."""
        with detached(ROUTER_RELEASE, root, key):
            await self.release(reservation_id)

    async def clean_up(self, run: RequestState, track: Track) -> None:
        """Close everything ``run`` opened: cancel open calls (read a finished stream to its
        end), delete a KV payload nobody picked up, release the reservation. A reservation
        that Assign may still commit is released in the background, through ``track``."""
        drains = [self.drain(c) for c in run.calls if c is run.finished_stream and not run.wound_up]
        for call in run.calls:
            if call is not run.finished_stream and not call.done():
                call.cancel()
        if run.kv is None and run.prefill_call is not None:
            # The prefill may have answered just as we left: its KV then needs deleting too.
            run.kv = await late_kv(run.prefill_call)
        if run.renewer is not None:
            run.renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run.renewer
        # These log their own failures (a failed release only means waiting for the TTL).
        await asyncio.gather(*run.tasks, *drains)
        if run.kv is not None and not run.kv_consumed:
            await self.delete_kv(run.kv)
        if not run.reservation_id and run.assign_task is not None:
            # The caller stopped waiting for Assign, which may still commit a reservation: wait
            # for it in the background (its owner's close() waits too), not on the caller's time.
            track(self.release_when_assigned(run.request.request_id, run.assign_task))
        if run.reservation_id and not run.wound_up:
            await self.release(run.reservation_id)
