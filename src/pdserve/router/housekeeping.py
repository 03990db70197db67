"""The calls that tidy up after a request: releases, renewals, KV deletions, stream ends.

Each is best effort by design: a failure is logged and the state it concerns expires on its
own (a reservation by its TTL, a KV payload by its lease), so it never fails a request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from grpc.aio import AioRpcError

from pdserve.errors import PdServeError
from pdserve.router.channels import ChannelPool
from pdserve.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)


class Housekeeper:
    """Talks to the scheduler and the KV stores on behalf of finished requests."""

    def __init__(
        self,
        channels: ChannelPool,
        scheduler_address: str,
        *,
        timeout_s: float = 5.0,
        renew_fraction: float = 0.5,
    ) -> None:
        self.channels = channels
        self.scheduler_address = scheduler_address
        self.timeout_s = timeout_s
        """Bound on each call; a stuck call must not pin the request."""
        self.renew_fraction = renew_fraction
        """Renew a reservation after this fraction of its TTL."""

    def _scheduler(self) -> scheduler_pb2_grpc.SchedulerStub:
        return scheduler_pb2_grpc.SchedulerStub(self.channels.get(self.scheduler_address))

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
        """Scheduler.Release (only the prefill share with ``prefill_only``)."""
        try:
            await self._scheduler().Release(
                scheduler_pb2.ReleaseRequest(
                    reservation_id=reservation_id, prefill_only=prefill_only
                ),
                timeout=self.timeout_s,
            )
        except AioRpcError as err:
            # The reservation expires by its TTL; the request itself is unaffected.
            logger.warning(
                "Release of reservation %s failed (%s: %s); it expires by its TTL",
                reservation_id, err.code().name, err.details(),
            )  # fmt: skip

    async def renew_forever(self, reservation_id: str, ttl_s: float) -> None:
        """Renew the reservation before each TTL runs out, until cancelled or it is gone."""
        while True:
            # A timer, not synchronisation: renew well before the reservation would expire.
            await asyncio.sleep(max(0.05, ttl_s * self.renew_fraction))
            try:
                resp = await self._scheduler().Renew(
                    scheduler_pb2.RenewRequest(reservation_id=reservation_id),
                    timeout=self.timeout_s,
                )
            except AioRpcError as err:
                if err.code() is grpc.StatusCode.NOT_FOUND:
                    logger.warning("reservation %s expired before it was renewed", reservation_id)
                    return
                logger.warning("Renew of %s failed: %s", reservation_id, err.details())
                continue
            ttl_s = resp.ttl_s

    async def delete_kv(self, kv: common_pb2.KVHandle) -> None:
        """Delete a KV payload from the store its handle names (absent is fine)."""
        where = kv.WhichOneof("location")
        if where == "store":
            address, key = kv.store.address, kv.store.key
        elif where == "direct":
            address, key = kv.direct.address, kv.direct.key
        else:
            return  # shm / engine-native state is owned by the workers
        stub = kvstore_pb2_grpc.KVStoreStub(self.channels.get(address))
        try:
            await stub.Delete(kvstore_pb2.DeleteRequest(key=key), timeout=self.timeout_s)
        except AioRpcError as err:
            if err.code() is not grpc.StatusCode.NOT_FOUND:
                logger.warning("KV delete of %s at %s failed: %s", key, address, err.details())

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
