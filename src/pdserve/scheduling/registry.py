"""Worker heartbeats in Redis: the registry that reads and writes them, and the Heartbeater.

A worker is alive exactly while its heartbeat key exists: each heartbeat SETs the key with a
TTL (three intervals by default), so a worker that stops beating disappears after the TTL
without anyone cleaning up. ``pdserve:workers`` indexes the ids so that listing needs no SCAN.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel  # the async client wants the async Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.keys import KeySpace, text
from pdserve.scheduling.redis_url import client_for
from pdserve.scheduling.worker_info import WorkerInfo

logger = logging.getLogger(__name__)

INDEX_RETENTION_S = 600.0
"""Index entries of workers silent this long are pruned; heartbeat TTLs must be shorter."""


def connect(url: str, *, timeout_s: float = 2.0, retries: int = 2) -> Redis:
    """An asyncio Redis client with bounded connect and command times.

    ``url`` may carry credentials and TLS: ``redis://user:password@host:port/db`` (AUTH),
    ``rediss://...`` (TLS; ``?ssl_ca_certs=PATH`` names a private CA, ``ssl_certfile`` and
    ``ssl_keyfile`` a client certificate).

    Without socket timeouts a Redis that stops answering (instead of refusing) would stall
    heartbeats and scheduling decisions indefinitely. A command that meets a dropped connection
    (Redis restarted, idle connection closed) is retried ``retries`` times on a new connection;
    a transaction whose WATCH was lost that way fails with WatchError instead.

    ``redis+sentinel://`` URLs (``redis_url``) reach the master that Sentinel names, and
    find the new one after a failover.
    """
    options = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "health_check_interval": 30,
        "retry": Retry(ExponentialBackoff(cap=0.2, base=0.01), retries),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }
    client: Redis = client_for(url, options, redis_class=Redis, sentinel_class=Sentinel)
    return client


class RedisWorkerRegistry:
    """Reads and writes worker heartbeats in one namespace of a Redis database."""

    def __init__(self, redis: Redis, *, keys: KeySpace | None = None) -> None:
        self.redis = redis
        self.keys = keys or KeySpace()
        # worker id -> (its heartbeat's bytes, parsed) as of the last listing. A scheduler
        # lists several times per heartbeat interval, so most heartbeats have not changed;
        # parsing dozens of them on the event loop is what delayed the decisions waiting
        # behind a refresh. Holds only the workers of the last listing.
        self._parsed: dict[str, tuple[bytes | str, WorkerInfo]] = {}

    async def heartbeat(
        self, info: WorkerInfo, ttl_s: float, *, read_key: str | None = None
    ) -> bytes | None:
        """Publish ``info`` as the worker's state for the next ``ttl_s`` seconds; with
        ``read_key``, read that key in the same round trip and return its value.

        ``info.ts`` is stamped with the current time when it is 0.
        """
        if not 0 < ttl_s < INDEX_RETENTION_S:
            raise InvalidArgumentError(
                "ttl_s", f"must be in (0, {INDEX_RETENTION_S:g}), got {ttl_s}"
            )
        if info.ts == 0:
            info = replace(info, ts=time.time())
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.worker(info.id), info.to_json(), px=max(1, round(ttl_s * 1000)))
            pipe.zadd(self.keys.worker_index, {info.id: info.ts})
            if read_key is not None:
                pipe.get(read_key)
            replies = await pipe.execute()
        return replies[2] if read_key is not None else None

    async def get(self, worker_id: str) -> WorkerInfo | None:
        """The worker's live heartbeat, or None if it has expired."""
        raw = await self.redis.get(self.keys.worker(worker_id))
        return None if raw is None else WorkerInfo.from_json(raw)

    async def list_workers(self) -> list[WorkerInfo]:
        """Every worker whose heartbeat is alive, sorted by id.

        A heartbeat that does not parse is logged and left out: one broken worker must not
        stop the scheduling of all the others.
        """
        index = self.keys.worker_index
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(index, "-inf", time.time() - INDEX_RETENTION_S)
            pipe.zrange(index, 0, -1)
            _, raw_ids = await pipe.execute()
        ids = sorted(text(i) for i in raw_ids)
        if not ids:
            return []
        raws = await self.redis.mget([self.keys.worker(i) for i in ids])
        workers: list[WorkerInfo] = []
        parsed: dict[str, tuple[bytes | str, WorkerInfo]] = {}
        for worker_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                continue  # expired: the worker is gone
            known = self._parsed.get(worker_id)
            if known is not None and known[0] == raw:
                info = known[1]  # the same heartbeat as last time (WorkerInfo is frozen)
            else:
                try:
                    info = WorkerInfo.from_json(raw)
                except InvalidArgumentError as err:
                    logger.error("ignoring unreadable heartbeat of worker %s: %s", worker_id, err)
                    continue
            parsed[worker_id] = (raw, info)
            workers.append(info)
        self._parsed = parsed
        return workers

    async def remove(self, worker_id: str) -> bool:
        """Delete the worker's heartbeat now; True if it was there."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.worker(worker_id))
            pipe.zrem(self.keys.worker_index, worker_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)


class Heartbeater:
    """Publishes a worker's state every ``interval_s`` until stopped.

    Lifecycle: ``start()`` launches one task (kept on the instance) that calls ``provider()``
    and writes the result, then sleeps until the next interval. Redis errors are logged once
    per outage, counted in ``errors`` and retried on the next tick, so the worker reappears by
    itself after a Redis restart. Any other exception (a bug in the provider) ends the task and
    is raised again by ``stop()``. ``stop()`` ends the task and, by default, deletes the key so
    that schedulers drop the worker at once instead of after the TTL.
    """

    def __init__(
        self,
        registry: RedisWorkerRegistry,
        provider: Callable[[], WorkerInfo],
        *,
        interval_s: float = 1.0,
        read_key: str | None = None,
        on_read: Callable[[bytes | None], None] | None = None,
    ) -> None:
        """``read_key``/``on_read``: each beat also reads that key; its value (None when
        absent) goes to ``on_read`` (a planner's order to the worker, say)."""
        if not interval_s > 0:
            raise InvalidArgumentError("interval_s", f"must be > 0, got {interval_s}")
        self.registry = registry
        self.provider = provider
        self.read_key = read_key
        self.on_read = on_read
        self.interval_s = interval_s
        self.ttl_s = 3 * interval_s
        self.beats = 0
        """Heartbeats written."""
        self.errors = 0
        """Heartbeats that failed on a Redis error."""
        self._failing = False
        self._worker_id: str | None = None
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Launch the heartbeat task; the first heartbeat is written right away."""
        if self._task is not None:
            raise RuntimeError("Heartbeater already started")
        self._stopping.clear()
        self._task = asyncio.create_task(self._run(), name="pdserve-heartbeat")

    async def stop(self, *, deregister: bool = True) -> None:
        """End the task; with ``deregister`` delete the worker's key (best effort)."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping.set()
        try:
            await task
        finally:
            if deregister and self._worker_id is not None:
                try:
                    await self.registry.remove(self._worker_id)
                except (RedisError, OSError) as err:
                    # Not fatal: the key expires on its own within ttl_s.
                    logger.warning(
                        "could not delete heartbeat of %s (it expires in %.1fs): %s",
                        self._worker_id,
                        self.ttl_s,
                        err,
                    )

    async def __aenter__(self) -> Heartbeater:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_beat = loop.time()
        while not self._stopping.is_set():
            await self._beat_once()
            # Fixed-rate schedule; after a stall, resume from now instead of bursting.
            next_beat = max(next_beat + self.interval_s, loop.time())
            try:
                await asyncio.wait_for(self._stopping.wait(), timeout=next_beat - loop.time())
            except TimeoutError:
                continue

    async def _beat_once(self) -> None:
        info = self.provider()
        self._worker_id = info.id
        try:
            # A beat that takes longer than the TTL is useless: the key has expired meanwhile.
            async with asyncio.timeout(self.ttl_s):
                value = await self.registry.heartbeat(info, self.ttl_s, read_key=self.read_key)
        except (RedisError, OSError, TimeoutError) as err:
            self.errors += 1
            if not self._failing:  # log once per outage, not once per tick
                logger.warning(
                    "heartbeat of %s failed, retrying every %.1fs: %s",
                    info.id,
                    self.interval_s,
                    err,
                )
            self._failing = True
            return
        self.beats += 1
        if self.on_read is not None:
            self.on_read(value)
        if self._failing:
            logger.info("heartbeat of %s recovered (%d errors so far)", info.id, self.errors)
            self._failing = False
