"""A worker's heartbeat: its identity plus its engine's load, written to Redis every interval.

The load comes from ``AsyncEngine.snapshot()`` (published by the engine thread after each
step), so building a heartbeat never waits for the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv_payload import KVLayout
from pdserve.scheduling import Heartbeater, RedisWorkerRegistry, WorkerInfo, WorkerRole
from pdserve.worker.async_engine import AsyncEngine
from pdserve.worker.engine_state import EngineSnapshot


def kv_fingerprint(layout: KVLayout) -> str:
    """What must match between a KV writer and reader: the weights and the KV dtype.

    The block size is left out on purpose: payloads are token-major, so engines with different
    block sizes exchange them fine.
    """
    return f"{layout.model_fingerprint}-{layout.dtype}"


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """The parts of a heartbeat that do not change while the worker runs."""

    id: str
    role: WorkerRole
    address: str
    """host:port at which other components reach the worker's gRPC server."""
    host: str
    model_fingerprint: str
    max_batch_tokens: int


def worker_info(
    identity: WorkerIdentity,
    snapshot: EngineSnapshot,
    *,
    draining: bool,
    interval_s: float = 0.0,
) -> WorkerInfo:
    """One heartbeat from the worker's identity and an engine snapshot; ``interval_s``: the
    time to the next one (a scheduler takes a worker two intervals late for gone)."""
    stats = snapshot.stats
    return WorkerInfo(
        id=identity.id,
        role=identity.role,
        address=identity.address,
        host=identity.host,
        model_fingerprint=identity.model_fingerprint,
        kv_blocks_total=stats.num_blocks_total,
        kv_blocks_free=stats.num_blocks_free,
        block_size=stats.block_size,
        max_batch_tokens=identity.max_batch_tokens,
        queued_tokens=stats.queued_tokens,
        running_seqs=stats.num_running,
        draining=draining,
        reservations=snapshot.tags,
        interval_s=interval_s,
    )


class WorkerHeartbeat:
    """Publishes ``worker_info`` of one AsyncEngine through a ``Heartbeater``.

    ``start()`` begins beating, ``mark_draining()`` flags the worker as taking no new work
    from the next beat on, ``stop()`` ends the beats and deletes the worker's key. A worker
    whose engine failed for good (``EngineSnapshot.failed``) says ``draining`` too: the
    scheduler places nothing on it.
    """

    def __init__(
        self,
        registry: RedisWorkerRegistry,
        identity: WorkerIdentity,
        engine: AsyncEngine,
        *,
        interval_s: float = 1.0,
    ) -> None:
        self.identity = identity
        self.engine = engine
        self.draining = False
        self.interval_s = interval_s
        self._heartbeater = Heartbeater(registry, self.current, interval_s=interval_s)

    def current(self) -> WorkerInfo:
        """The heartbeat as of now."""
        snapshot = self.engine.snapshot()
        return worker_info(
            self.identity,
            snapshot,
            draining=self.draining or snapshot.failed,
            interval_s=self.interval_s,
        )

    @property
    def errors(self) -> int:
        """Heartbeats that failed on a Redis error so far."""
        return self._heartbeater.errors

    def start(self) -> None:
        self._heartbeater.start()

    def mark_draining(self) -> None:
        self.draining = True

    async def stop(self) -> None:
        await self._heartbeater.stop(deregister=True)
