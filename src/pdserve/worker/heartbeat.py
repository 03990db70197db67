"""A worker's heartbeat: its identity plus its engine's load, written to Redis every interval.

The load and the step-time model come from ``EngineBackend.capacity()`` (the engine's latest
published figures), so building a heartbeat never waits for the engine. Each beat also reads
the duty a planner set for the worker (``duty.Duty``) in the same round trip.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.backends import Capacity, EngineBackend
from pdserve.scheduling.registry import Heartbeater, RedisWorkerRegistry
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole
from pdserve.transfer.bandwidth import BandwidthMeter
from pdserve.transfer.links import Links
from pdserve.worker.duty import Duty


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
    max_seqs: int = 0
    """The engine's batch slots (``EngineBackend.max_num_seqs``; 0: unknown)."""
    lane: str = "any"
    kv_bytes_per_token: int = 0
    interactive_tokens: int = 0
    """The host lease's bulk threshold (0: no lease): ``WorkerInfo.interactive_tokens``."""
    transports: tuple[str, ...] = ()
    """What its hand-off policy picks from: ``WorkerInfo.transports``."""
    kv_agent: tuple[str, str] = ("", "")
    """Its NIXL agent's descriptor and fingerprint: ``WorkerInfo.kv_agent``."""
    prefix_store: str = ""
    """``WorkerInfo.prefix_store``."""


def worker_info(
    identity: WorkerIdentity,
    load: Capacity,
    *,
    draining: bool,
    interval_s: float = 0.0,
    duty: Duty | None = None,
    links: tuple[tuple[str, str, float], ...] = (),
    bandwidth: tuple[float, float] | None = None,
    now: float | None = None,
) -> WorkerInfo:
    """One heartbeat from the worker's identity and its engine's load; ``interval_s``: the
    time to the next one (a scheduler takes a worker two intervals late for gone); ``now``
    (``perf_counter``) ages the busy share over an idle stretch; ``bandwidth``: the KV links'
    live ``(10 s average, 100 ms peak)`` bytes/s (None: not metered)."""
    serves: tuple[str, ...] = ()
    duty_name, switching = "", False
    if duty is not None:
        idle = load.running == 0 and load.waiting == 0 and load.held == 0
        serves, duty_name, switching = duty.state(idle=idle)
    steps = load.steps
    return WorkerInfo(
        id=identity.id,
        role=identity.role,
        address=identity.address,
        host=identity.host,
        model_fingerprint=identity.model_fingerprint,
        kv_blocks_total=load.blocks_total,
        kv_blocks_free=load.blocks_free,
        block_size=load.block_size,
        max_batch_tokens=identity.max_batch_tokens,
        queued_tokens=load.queued_tokens,
        running_seqs=load.running,
        waiting_decodes=load.waiting_decodes,
        max_seqs=identity.max_seqs,
        draining=draining,
        reservations=load.tags,
        interval_s=interval_s,
        serves=serves,
        capabilities=duty.capabilities if duty is not None else (),
        lane=identity.lane,
        duty=duty_name,
        switching=switching,
        step_overhead_s=steps.overhead_s,
        decode_seq_s=steps.decode_seq_s,
        prefill_token_s=steps.prefill_token_s,
        busy=steps.busy_at(time.perf_counter() if now is None else now),
        links=links,
        kv_bytes_per_token=identity.kv_bytes_per_token,
        interactive_tokens=identity.interactive_tokens,
        transports=identity.transports,
        prefix_store=identity.prefix_store,
        kv_bytes_per_s=None if bandwidth is None else bandwidth[0],
        kv_peak_bytes_per_s=None if bandwidth is None else bandwidth[1],
        kv_agent=identity.kv_agent[0],
        kv_agent_fingerprint=identity.kv_agent[1],
    )


class WorkerHeartbeat:
    """Publishes ``worker_info`` of one engine backend through a ``Heartbeater``.

    ``start()`` begins beating, ``mark_draining()`` flags the worker as taking no new work
    from the next beat on, ``stop()`` ends the beats and deletes the worker's key. A worker
    whose engine failed for good (``Capacity.failed``) says ``draining`` too: the
    scheduler places nothing on it.
    """

    def __init__(
        self,
        registry: RedisWorkerRegistry,
        identity: WorkerIdentity,
        engine: EngineBackend,
        *,
        interval_s: float = 1.0,
        duty: Duty | None = None,
        links: Links | None = None,
        bandwidth: Sequence[BandwidthMeter] = (),
    ) -> None:
        """``duty``: follow a planner's orders (mixed workers); ``links``: the prefill
        side's KV links (``transfer.links.Links``); ``bandwidth``: the connectors' meters,
        whose live figures each beat publishes (summed)."""
        self.identity = identity
        self.engine = engine
        self.draining = False
        self.interval_s = interval_s
        self.duty = duty
        self.links = links
        self.bandwidth = tuple(bandwidth)
        self._heartbeater = Heartbeater(
            registry,
            self.current,
            interval_s=interval_s,
            read_key=registry.keys.duty(identity.id) if duty is not None else None,
            on_read=duty.order if duty is not None else None,
        )

    def current(self) -> WorkerInfo:
        """The heartbeat as of now."""
        load = self.engine.capacity()
        return worker_info(
            self.identity,
            load,
            draining=self.draining or load.failed,
            interval_s=self.interval_s,
            duty=self.duty,
            links=self.links.published() if self.links is not None else (),
            bandwidth=self._bandwidth(),
        )

    def _bandwidth(self) -> tuple[float, float] | None:
        """The meters' ``(average, peak)`` bytes/s added up; None without a meter."""
        if not self.bandwidth:
            return None
        totals = [meter.totals() for meter in self.bandwidth]
        return sum(t[0] for t in totals), sum(t[1] for t in totals)

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
