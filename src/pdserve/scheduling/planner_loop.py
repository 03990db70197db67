"""The planner's loop: every interval, lead or wait; when leading, decide and order a move.

``PlannerLoop.run`` until cancelled (the service runs it as one task beside its health
server). Each pass: hold the leader lease (``planner.LeaderLease``); if this replica leads
and no cooldown runs, read every heartbeat and the live reservations, let ``planner.decide``
pick the moves (none, one, or several together) and write each to its worker's duty key;
report pressures, moves and leadership to ``on_pass``. It moves nothing until it has seen
the same workers for ``settle_passes`` passes in a row. A Redis outage is logged once and
retried on the next pass. The lease is given up on the way out, so another replica takes
over at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.scheduling.capacity import WorkerView
from pdserve.scheduling.costmodel import CostModel
from pdserve.scheduling.keys import KeySpace, text
from pdserve.scheduling.planner import (
    LeaderLease,
    Move,
    PlannerConfig,
    Pressure,
    Shed,
    decide,
    local_hour,
    pressure,
)
from pdserve.scheduling.registry import RedisWorkerRegistry
from pdserve.scheduling.reservations import ReservationLedger

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pass:
    """What one pass saw and did."""

    leading: bool
    pressure: Pressure | None
    moves: tuple[Move, ...] = ()


class PlannerLoop:
    def __init__(
        self,
        redis: Redis,
        keys: KeySpace,
        config: PlannerConfig,
        *,
        holder: str,
        interval_s: float = 1.0,
        lease_ttl_s: float = 5.0,
        dry_run: bool = False,
        settle_passes: int = 3,
        on_pass: Callable[[Pass], None] | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.config = config
        self.model = CostModel(itl_slo_s=config.itl_slo_s)
        self.interval_s = interval_s
        self.dry_run = dry_run
        self.on_pass = on_pass
        self.lease = LeaderLease(redis, keys, holder, ttl_s=lease_ttl_s)
        self.registry = RedisWorkerRegistry(redis, keys=keys)
        self.ledger = ReservationLedger(redis, keys)
        self.moves: list[Move] = []
        """Moves ordered so far (dry-run ones included)."""
        self.settle_passes = settle_passes
        self._quiet_until = 0.0
        self._leading = False
        self._workers: frozenset[str] = frozenset()
        self._settled = 0  # passes in a row that saw the same workers
        self._refused: dict[str, int] | None = None  # the schedulers' refusal counters

    async def run(self) -> None:
        """Pass every ``interval_s`` until cancelled; then give the lease up."""
        failing = False
        try:
            while True:
                try:
                    result = await self.run_once()
                except (RedisError, OSError) as err:
                    if not failing:
                        logger.warning("planner pass failed, retrying: %s", err)
                    failing = True
                else:
                    failing = False
                    if self.on_pass is not None:
                        self.on_pass(result)
                await asyncio.sleep(self.interval_s)  # the decision period, a timer
        finally:
            await asyncio.shield(self._release())

    async def _release(self) -> None:
        try:
            await self.lease.release()
        except (RedisError, OSError) as err:  # it expires by itself within its TTL
            logger.warning("could not give the planner lease up: %s", err)

    async def _shed(self) -> Shed:
        """What the schedulers refused since the previous pass (none on the first)."""
        raw = await self.redis.hgetall(self.keys.refused)
        now = {text(k): int(v) for k, v in raw.items()}
        before, self._refused = self._refused, now
        return Shed() if before is None else Shed.between(before, now)

    async def run_once(self) -> Pass:
        leading = await self.lease.hold()
        if leading != self._leading:
            logger.info("planner %s %s", self.lease.holder, "leads" if leading else "follows")
            self._leading = leading
        if not leading:
            return Pass(False, None)
        infos = await self.registry.list_workers()
        shed = await self._shed()
        reserved, now_s = await self.ledger.reserved_on(infos)
        views = [WorkerView(i, reserved[i.id], max(0.0, now_s - i.ts)) for i in infos]
        pr = pressure(views, self.model, self.config)
        workers = frozenset(i.id for i in infos)
        self._settled = self._settled + 1 if workers == self._workers else 0
        self._workers = workers
        logger.debug("pressure: prefill %.2f, decode %.2f", pr.prefill, pr.decode)
        if time.monotonic() < self._quiet_until or self._settled < self.settle_passes:
            return Pass(True, pr)
        moves = decide(views, self.model, self.config, hour=local_hour(), shed=shed)
        for move in moves:
            logger.info(
                "move %s to %s duty (%s; prefill pressure %.2f over %d workers, decode %.2f "
                "over %d)%s", move.worker_id, move.duty, move.reason, pr.prefill,
                pr.prefill_workers, pr.decode, pr.decode_workers,
                " [dry run]" if self.dry_run else "",
            )  # fmt: skip
            if not self.dry_run:
                await self.redis.set(self.keys.duty(move.worker_id), move.duty)
            self.moves.append(move)
        if moves:
            self._quiet_until = time.monotonic() + self.config.cooldown_s
        return Pass(True, pr, moves)
