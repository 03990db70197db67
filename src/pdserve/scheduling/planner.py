"""The online P:D planner: moves mixed workers between prefill and decode duty as load shifts.

Inputs, every ``interval_s``, from the workers' heartbeats and the live reservations only (no
offline profile): through the cost model (``costmodel``),

* **prefill pressure**: the predicted wait of a new prompt on the prefill side (the least
  loaded prefill-duty worker's queue, reservations included) over the TTFT SLO, or that
  queue's share of the scheduler's admission limit (``CapacityLimits``), whichever is
  larger: the scheduler refuses prompts beyond the limit, so a side that sheds load shows it
  as pressure 1 though its queue, held short, predicts a short wait;
* **decode pressure**: the largest of: the predicted gap between tokens on the busiest
  decode-duty worker (its decode step, plus what a step carrying the prompt tokens queued
  there adds: a decode-duty mixed worker also serves colocated requests) over the ITL SLO;
  the share of KV blocks in use on the fullest one; and the share of the decode side's batch
  slots taken, counting the handed-over sequences that wait for one (running plus waiting
  decodes over the engines' ``max_num_seqs``; prompts waiting there are the stall term's).
  The last is what saturates first on an accelerator, whose decode step hardly grows with
  the batch: with every slot taken, new streams queue though no step is slow.

So 1 means "at the SLO" (or "KV full", or "every slot taken"). A side is *saturated* when
its pressure reaches 1 or the schedulers refused requests for want of its capacity since the
last pass (``Shed``, from ``KeySpace.refused``): then its pressure hides how much more it
needs, so it takes as many workers as the other side can spare. The engines' busy shares are
not terms: on a host whose engines share the cores, every engine looks busy while it waits
for them. When one side is above ``high`` and the other below ``high`` and either below
``low`` or at most half as loaded, switchable workers (mixed workers with a KV store:
``WorkerInfo.switchable``) move over, the least loaded of the relaxed side first: as many
as bring the asking side's pressure, spread over more workers, down to the middle of
``low`` and ``high``, while the giving side's, spread over fewer, stays below ``high``
(``moves_for``). Moving them together costs one drain rather than one per worker: a mix
that shifts needs the new split before the queue it builds outlasts the shift.
Counts stay within ``min_*``/``max_*`` (by default at least one worker on each side; a
time-of-day ``Profile`` may set them per hour); after a move the planner waits ``cooldown_s``
and for every worker to finish switching. It acts only on a settled view: the same workers
for a few passes in a row (at start-up, or while a worker joins or leaves, the view is
partial).

A move is an order in Redis (``{ns}:duty:{worker_id}``) that the worker reads with its next
heartbeat; it drains its old duty's work before it takes the new one (``worker.duty``), so
nothing in flight is lost. Several planner replicas may run: one leads at a time
(``LeaderLease``), the others wait to take over.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.capacity import CapacityLimits, WorkerView
from pdserve.scheduling.costmodel import CostModel, decoding
from pdserve.scheduling.keys import KeySpace, text

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True, slots=True)
class Bounds:
    """How many workers each duty may have (dedicated prefill or decode workers count
    towards their side; only switchable ones move)."""

    min_prefill: int = 1
    max_prefill: int = 1 << 30
    min_decode: int = 1
    max_decode: int = 1 << 30

    def __post_init__(self) -> None:
        if not 0 <= self.min_prefill <= self.max_prefill:
            raise InvalidArgumentError("min_prefill", f"need 0 <= min <= max, got {self}")
        if not 0 <= self.min_decode <= self.max_decode:
            raise InvalidArgumentError("min_decode", f"need 0 <= min <= max, got {self}")


@dataclass(frozen=True, slots=True)
class Profile:
    """Bounds that apply during ``[start_hour, end_hour)`` (local time; may wrap midnight)."""

    start_hour: int
    end_hour: int
    bounds: Bounds

    def covers(self, hour: int) -> bool:
        if self.start_hour <= self.end_hour:
            return self.start_hour <= hour < self.end_hour
        return hour >= self.start_hour or hour < self.end_hour

    @classmethod
    def parse(cls, spec: str) -> Profile:
        """``"8-20:prefill=1..2,decode=1..3"``."""
        try:
            hours, _, rest = spec.partition(":")
            start, end = (int(h) % 24 for h in hours.split("-"))
            limits: dict[str, tuple[int, int]] = {}
            for part in rest.split(","):
                duty, _, span = part.partition("=")
                lo, _, hi = span.partition("..")
                limits[duty.strip()] = (int(lo), int(hi))
            bounds = Bounds(*limits.get(PREFILL, (0, 1 << 30)), *limits.get(DECODE, (1, 1 << 30)))
        except ValueError as err:
            raise InvalidArgumentError(
                "profile", f"expected H-H:prefill=MIN..MAX,decode=MIN..MAX, got {spec!r} ({err})"
            ) from None
        return cls(start, end, bounds)


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    ttft_slo_s: float = 3.0
    itl_slo_s: float = 0.150
    high: float = 0.6
    """A side whose pressure is above this asks for a worker."""
    low: float = 0.3
    """A side gives a worker only while its pressure is below this."""
    cooldown_s: float = 10.0
    bounds: Bounds = field(default_factory=Bounds)
    profiles: tuple[Profile, ...] = ()
    limits: CapacityLimits = field(default_factory=CapacityLimits)
    """The scheduler's admission limits (its ``--prefill-queue-batches``)."""

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise InvalidArgumentError("low", f"need 0 <= low < high, got {self.low}, {self.high}")
        if not self.ttft_slo_s > 0 or not self.itl_slo_s > 0:
            raise InvalidArgumentError("ttft_slo_s", "the SLOs must be > 0")

    def bounds_at(self, hour: int) -> Bounds:
        for profile in self.profiles:
            if profile.covers(hour):
                return profile.bounds
        return self.bounds


@dataclass(frozen=True, slots=True)
class Pressure:
    prefill: float
    decode: float
    prefill_workers: int
    decode_workers: int


@dataclass(frozen=True, slots=True)
class Shed:
    """Requests the schedulers refused for want of each side's capacity since the last pass
    (prefill; decode, colocated requests included: decode-duty workers serve them)."""

    prefill: int = 0
    decode: int = 0

    @classmethod
    def between(cls, before: dict[str, int], after: dict[str, int]) -> Shed:
        """From two readings of the ``refused`` counters (phase -> count)."""

        def grew(*phases: str) -> int:
            return sum(max(0, after.get(p, 0) - before.get(p, 0)) for p in phases)

        return cls(grew("prefill"), grew("decode", "colocated"))


@dataclass(frozen=True, slots=True)
class Move:
    """One duty order: ``worker_id`` to ``duty``, and why."""

    worker_id: str
    duty: str
    reason: str


def duty_of(view: WorkerView) -> str:
    """The duty a switchable worker serves (or is switching to): prefill or decode."""
    info = view.info
    if info.duty:
        return info.duty
    return DECODE if "decode" in info.phases else PREFILL


def pressure(views: Sequence[WorkerView], model: CostModel, config: PlannerConfig) -> Pressure:
    """The two sides' pressures (see the module docstring)."""
    prefills = [v for v in views if "prefill" in v.info.phases or v.info.duty == PREFILL]
    decodes = [v for v in views if "decode" in v.info.phases or v.info.duty == DECODE]
    p = 0.0
    if prefills:
        p = min(
            max(
                model.queue_s(v) / config.ttft_slo_s,
                v.pending_tokens / max(1, config.limits.max_pending_tokens(v.info)),
            )
            for v in prefills
        )
    d = 0.0
    if decodes:
        steps = [
            model.decode_step_s(v.info, decoding(v)) + model.stall_on(v, 0)
            for v in decodes
            if decoding(v)
        ]
        used = max(1 - v.free_blocks / max(1, v.info.kv_blocks_total) for v in decodes)
        d = max(max(steps, default=0.0) / config.itl_slo_s, used, slots_taken(decodes))
    return Pressure(p, d, len(prefills), len(decodes))


def slots_taken(decodes: Sequence[WorkerView]) -> float:
    """Sequences running or waiting for a batch slot on the decode side, over its slots (0
    where no worker publishes its ``max_seqs``). Above 1, streams queue for a slot."""
    sized = [v.info for v in decodes if v.info.max_seqs > 0]
    slots = sum(i.max_seqs for i in sized)
    return sum(i.running_seqs + i.waiting_decodes for i in sized) / slots if slots else 0.0


def _relaxed(asking: float, giving: float, config: PlannerConfig) -> bool:
    """The ``giving`` side can spare a worker to the ``asking`` side."""
    return (
        asking > config.high
        and giving < config.high
        and (giving < config.low or asking >= 2 * giving)
    )


def decide(
    views: Sequence[WorkerView],
    model: CostModel,
    config: PlannerConfig,
    *,
    hour: int,
    shed: Shed = Shed(),
) -> tuple[Move, ...]:
    """The moves for the cluster ``views`` (none, one, or several that go together: see
    the module docstring); ``shed``: what the schedulers refused since the last pass."""
    switchable = [v for v in views if v.info.switchable and not v.info.draining]
    if not switchable or any(v.info.switching for v in switchable):
        return ()
    bounds = config.bounds_at(hour)
    on = {PREFILL: [v for v in switchable if duty_of(v) == PREFILL],
          DECODE: [v for v in switchable if duty_of(v) == DECODE]}  # fmt: skip
    fixed = [v for v in views if not v.info.switchable and not v.info.draining]
    n_p = len(on[PREFILL]) + sum("prefill" in v.info.phases for v in fixed)
    n_d = len(on[DECODE]) + sum("decode" in v.info.phases for v in fixed)
    # Bounds first: a profile that just began may ask for another split outright.
    if (n_p < bounds.min_prefill or n_d > bounds.max_decode) and n_d > bounds.min_decode:
        return (Move(_least_busy(on[DECODE])[0].id, PREFILL, "bounds"),)
    if (n_d < bounds.min_decode or n_p > bounds.max_prefill) and n_p > bounds.min_prefill:
        return (Move(_least_busy(on[PREFILL])[0].id, DECODE, "bounds"),)
    pr = pressure(views, model, config)
    # A side that shed load is at least at pressure 1, whatever its queues show.
    p_ask = max(pr.prefill, 1.0) if shed.prefill else pr.prefill
    d_ask = max(pr.decode, 1.0) if shed.decode else pr.decode
    for asking, giving, to, n_to, n_from, room, reason in (
        (p_ask, pr.decode, PREFILL, n_p, n_d,
         min(n_d - bounds.min_decode, bounds.max_prefill - n_p), "prefill pressure"),
        (d_ask, pr.prefill, DECODE, n_d, n_p,
         min(n_p - bounds.min_prefill, bounds.max_decode - n_d), "decode pressure"),
    ):  # fmt: skip
        source = on[DECODE if to == PREFILL else PREFILL]
        if source and _relaxed(asking, giving, config):
            k = moves_for(asking, n_to, giving, n_from, min(room, len(source)), config)
            if k:
                return tuple(Move(v.id, to, reason) for v in _least_busy(source)[:k])
    return ()


def moves_for(
    asking: float, n_ask: int, giving: float, n_give: int, room: int, config: PlannerConfig
) -> int:
    """How many workers move from the giving side (pressure ``giving`` over ``n_give``
    workers) to the asking one, at most ``room``: enough that the asking side's pressure,
    taken as its load spread over more workers, falls to the middle of ``low`` and
    ``high``, but never so many that the giving side's rises to ``high``. A saturated side
    (``asking`` >= 1) hides its need, so it gets all that the giving side can spare. At
    least one (the caller found the sides relaxed for one)."""
    if room < 1:
        return 0
    target = (config.low + config.high) / 2
    need = room if asking >= 1 else math.ceil(max(1, n_ask) * asking / target) - n_ask
    k = max(1, min(need, room))
    while k > 1 and (k >= n_give or giving * n_give / (n_give - k) >= config.high):
        k -= 1
    return k


def _least_busy(views: Sequence[WorkerView]) -> list[WorkerView]:
    """``views``, the least loaded first."""
    return sorted(views, key=lambda v: (v.info.running_seqs + v.pending_tokens, v.info.busy, v.id))


class LeaderLease:
    """One leader among planner replicas: a Redis key holding the leader's id with a TTL,
    taken when free (SET NX) and extended only by its holder (compare and set, in Lua)."""

    _EXTEND = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
    )

    def __init__(self, redis: Redis, keys: KeySpace, holder: str, *, ttl_s: float = 5.0) -> None:
        if not ttl_s > 0:
            raise InvalidArgumentError("ttl_s", f"must be > 0, got {ttl_s}")
        self.redis = redis
        self.key = keys.planner_leader
        self.holder = holder
        self.ttl_ms = max(1, round(ttl_s * 1000))

    async def hold(self) -> bool:
        """Take or extend the lease; True while this replica leads."""
        extended = await self.redis.eval(self._EXTEND, 1, self.key, self.holder, self.ttl_ms)
        if extended:
            return True
        return bool(await self.redis.set(self.key, self.holder, nx=True, px=self.ttl_ms))

    async def leader(self) -> str | None:
        raw = await self.redis.get(self.key)
        return None if raw is None else text(raw)

    async def release(self) -> None:
        """Give the lease up now if held (another replica takes over at once)."""
        script = (
            "if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('del', KEYS[1]) else return 0 end"
        )
        await self.redis.eval(script, 1, self.key, self.holder)


def local_hour(now: float | None = None) -> int:
    return time.localtime(now).tm_hour
