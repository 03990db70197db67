"""ClusterScheduler: picks the workers for a request and reserves capacity on them.

Lifecycle of one ``assign()``:

1. Decide from the cache (``view_cache.ViewCache``): a view of every live worker (heartbeat plus
   reserved amounts) at most ``refresh_interval_s`` old, so a decision costs no Redis round trip
   to *choose* (the service refreshes it in the background, ``refresher``; without that, the
   decision that finds it too old refreshes it first). ``placement.Placer`` drops workers that
   are draining, excluded by the caller (they failed this request), that do not serve the phase,
   of another model, excluded earlier in this call, or too full on that view; orders the rest by
   the placement policy; decides the mode (``conditional``: colocated or disaggregated by the
   cost model) and, with a TTFT SLO, refuses a request that would miss it everywhere; a request
   migrating from a dead decode worker (``decode_only``) takes a decode worker alone. The
   request's prompt blocks are looked up in the KV event index (``prefix_index``), when one is
   kept. If nothing fits, the view is refreshed once before refusing, so a refusal is never based
   on data older than the call.
2. Take this process's commit lock of each chosen worker (so a replica's own concurrent
   assigns queue instead of invalidating each other), then WATCH the chosen workers'
   heartbeat keys and reservation sets.
3. Re-check on fresh data read under the WATCH: each worker is alive (its key exists, its
   heartbeat is not stale), not draining, both workers have the same model fingerprint, and each
   has room for this request on top of the live reservations it has not admitted yet (decode:
   ceil((prompt + max_tokens) / block_size) blocks <= free - reserved; prefill: pending + prompt
   tokens within its queue limit; see ``capacity.shortfall``).
4. MULTI/EXEC the reservation (``reservations.ReservationLedger``, whose docstring explains
   the Redis layout and why expired reservations stop counting): one sorted-set member per
   worker scored by its expiry, plus a record with the same TTL. If another scheduler committed
   on those workers (or a heartbeat landed) since step 2, EXEC fails with WatchError and nothing
   is written.
5. On WatchError: retry from 1 with a refreshed cache. On a failed re-check: exclude that worker
   for this call and retry. At most ``max_retries`` retries, then CapacityError
   (RESOURCE_EXHAUSTED), or WorkerUnavailableError (UNAVAILABLE) when no live worker of the
   needed role is left at all.
6. The caller hands ``reservation_id`` to the workers (which list it in their heartbeats once
   admitted, so it is not counted twice), calls ``renew()`` during long decodes, and
   ``release()`` when done (``prefill_only`` right after prefill). Reservations that are never
   released expire after ``reservation_ttl_s`` and stop counting.

Because step 4 commits only if nothing it read in step 3 changed, any number of scheduler
replicas can share one Redis without over-committing a worker.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import WatchError

from pdserve.errors import CapacityError, InvalidArgumentError, WorkerUnavailableError
from pdserve.quotas import TenantQuotas
from pdserve.scheduling.capacity import (
    CapacityLimits,
    Demand,
    Phase,
    WorkerView,
    capacity_error,
    ineligibility,
    shortfall,
    stale,
)
from pdserve.scheduling.costmodel import ArrivalRate, CostModel
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.placement import Mode, ModeDecision, Placement, Placer, Refusal
from pdserve.scheduling.policies import PlacementPolicy, make_policy
from pdserve.scheduling.prefix_index import PrefixIndex, PromptBlocks
from pdserve.scheduling.registry import RedisWorkerRegistry
from pdserve.scheduling.reservations import (
    RecheckFailedError,
    ReservationLedger,
    ReservationPart,
)
from pdserve.scheduling.view_cache import ViewCache
from pdserve.scheduling.worker_info import WorkerInfo

_EXPIRED = "heartbeat expired"
_STALE = "heartbeat stale"
_EXCLUDED = "excluded by the caller"
_GONE = (_EXPIRED, _STALE, _EXCLUDED)
logger = logging.getLogger(__name__)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


@contextlib.contextmanager
def _redis_reachable() -> Iterator[None]:
    """Report an unreachable Redis as UNAVAILABLE, not as an internal error."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as err:
        raise WorkerUnavailableError(f"Redis unreachable: {err}") from err


class SloRefusalError(CapacityError):
    """Admission refused the request: its predicted TTFT misses the SLO on every worker."""


_PHASES = {
    Mode.COLOCATED: (Phase.COLOCATED,),
    Mode.DISAGGREGATED: (Phase.PREFILL, Phase.DECODE),
    Mode.CONDITIONAL: (Phase.COLOCATED, Phase.PREFILL, Phase.DECODE),
}


@dataclass(frozen=True, slots=True)
class Assignment:
    """The outcome of ``assign``: where to run the request and what was reserved."""

    reservation_id: str
    prefill: WorkerInfo
    decode: WorkerInfo
    """The same worker as ``prefill`` in colocated mode."""
    mode: Mode
    retries: int
    """Retries after a conflict or failed re-check; 0 when the first try committed."""
    policy: str
    ttl_s: float
    decision: ModeDecision | None = None
    """The mode chosen and its inputs (predicted TTFTs, cached tokens, ...)."""


class ClusterScheduler:
    """Places requests on workers; safe to run as several replicas on one Redis."""

    def __init__(
        self,
        redis: Redis,
        *,
        keys: KeySpace | None = None,
        policy: PlacementPolicy | str = "least_loaded",
        refresh_interval_s: float = 0.25,
        reservation_ttl_s: float = 120.0,
        max_retries: int = 8,
        limits: CapacityLimits | None = None,
        default_mode: Mode = Mode.DISAGGREGATED,
        model: CostModel | None = None,
        long_prompt_tokens: int = 0,
        ttft_slo_s: float = 0.0,
        prefix_index: PrefixIndex | None = None,
        quotas: TenantQuotas | None = None,
        reservation_max_lifetime_s: float = 3600.0,
    ) -> None:
        """``model``: predictions for ``kv_aware``, ``conditional`` and admission;
        ``long_prompt_tokens`` (0: from the model) splits prompts between lanes;
        ``ttft_slo_s`` > 0 refuses requests predicted to miss it everywhere;
        ``prefix_index``: the KV event index (kept current by ``prefix_index.following``);
        ``quotas``: per-tenant caps on live reservations; ``reservation_max_lifetime_s``: no
        renewal keeps a reservation longer."""
        if not refresh_interval_s >= 0:
            raise InvalidArgumentError(
                "refresh_interval_s", f"must be >= 0, got {refresh_interval_s}"
            )
        if not isinstance(max_retries, int) or max_retries < 0:
            raise InvalidArgumentError(
                "max_retries", f"must be an integer >= 0, got {max_retries!r}"
            )
        self.keys = keys or KeySpace()
        self.redis = redis
        self.registry = RedisWorkerRegistry(redis, keys=self.keys)
        self.ledger = ReservationLedger(
            redis,
            self.keys,
            ttl_s=reservation_ttl_s,
            max_lifetime_s=max(reservation_max_lifetime_s, reservation_ttl_s),
        )
        self.quotas = quotas or TenantQuotas()
        if long_prompt_tokens < 0:
            raise InvalidArgumentError(
                "long_prompt_tokens", f"must be >= 0, got {long_prompt_tokens}"
            )
        if not ttft_slo_s >= 0:
            raise InvalidArgumentError("ttft_slo_s", f"must be >= 0, got {ttft_slo_s}")
        self.model = model or CostModel()
        self.policy = make_policy(policy, self.model) if isinstance(policy, str) else policy
        self.refresh_interval_s = refresh_interval_s
        self.max_retries = max_retries
        self.limits = limits or CapacityLimits()
        self.default_mode = Mode(default_mode)
        self.placer = Placer(
            self.policy,
            self.model,
            self.limits,
            long_prompt_tokens=long_prompt_tokens,
            ttft_slo_s=ttft_slo_s,
        )
        self.prefix_index = prefix_index
        self.cache = ViewCache(self.registry, self.ledger, prefix_index)
        self.conflicts = 0
        """Commits aborted by WatchError: another writer got there first (the service
        exports it)."""
        # One commit at a time per worker *within this process*: concurrent assigns of one
        # replica would otherwise invalidate each other's WATCH and burn their retries. WATCH
        # still arbitrates between replicas.
        self._commit_locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._jitter = random.Random()
        self.arrivals = ArrivalRate()
        """Requests per second reaching ``assign`` (for the cost model)."""

    # -- cache ---------------------------------------------------------------------------------

    async def snapshot(self, *, max_age_s: float | None = None) -> list[WorkerView]:
        """The cached view of live workers, refreshed first if older than ``max_age_s``
        (default ``refresh_interval_s``)."""
        limit = self.refresh_interval_s if max_age_s is None else max_age_s
        with _redis_reachable():
            await self.cache.refresh(not_before=time.monotonic() - limit)
        return sorted(self.cache.views.values(), key=lambda v: v.id)

    async def refresh(self) -> None:
        """Refresh the cached view from Redis now (``refresher.kept_fresh`` calls it)."""
        await self.cache.refresh(not_before=time.monotonic())

    # -- decisions -----------------------------------------------------------------------------

    async def assign(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        mode: Mode | None = None,
        tenant: str = "",
        prompt_token_ids: Sequence[int] = (),
        exclude: Sequence[str] = (),
        decode_only: bool = False,
    ) -> Assignment:
        """Choose workers for a request and reserve capacity on them (see module docstring).

        ``mode`` None takes ``default_mode``. ``tenant`` salts the prompt's block hashes (as
        the engines' prefix caches do) and its quota caps its live reservations
        (``QuotaExceededError``); ``prompt_token_ids`` (optional) let the KV event index
        count the prompt blocks each worker caches. ``exclude``: worker ids not to choose
        (they failed this request). ``decode_only``: reserve a decode worker alone (a
        migration; it recomputes the prompt), named as ``prefill`` too; colocated mode
        ignores it.
        """
        lookup = None
        if prompt_token_ids and self.prefix_index is not None:
            blocks, index = PromptBlocks(prompt_token_ids, tenant), self.prefix_index
            stores = {wid: v.info.prefix_store for wid, v in self.cache.views.items()}

            def lookup(worker_id: str) -> int:
                return blocks.reusable_tokens(index, worker_id, stores.get(worker_id, ""))

        self.arrivals.arrived()
        chosen_mode = self.default_mode if mode is None else Mode(mode)
        decode_only = decode_only and chosen_mode is not Mode.COLOCATED
        phases = (Phase.DECODE,) if decode_only else _PHASES[chosen_mode]
        demands = {ph: Demand(prompt_tokens, max_tokens, ph, lookup) for ph in phases}
        with _redis_reachable():
            return await self._assign(request_id, demands, chosen_mode, tenant, exclude)

    async def _assign(
        self,
        request_id: str,
        demands: Mapping[Phase, Demand],
        chosen_mode: Mode,
        tenant: str,
        exclude: Sequence[str],
    ) -> Assignment:
        any_demand = next(iter(demands.values()))
        prompt_tokens, max_tokens = any_demand.prompt_tokens, any_demand.max_tokens
        # worker id -> why it is out of this call (the caller's word, or a failed re-check)
        excluded: dict[str, str] = dict.fromkeys(exclude, _EXCLUDED)
        called_at = time.monotonic()
        for attempt in range(self.max_retries + 1):
            # A retry means our view was wrong somewhere: decide on data newer than the failure.
            not_before = time.monotonic() - (0.0 if attempt else self.refresh_interval_s)
            await self.cache.refresh(not_before=not_before)
            placed = self._place(demands, chosen_mode, excluded)
            if not isinstance(placed, Placement) and self.cache.refreshed_at < called_at:
                # Refuse only on data newer than the call: capacity may have just been freed.
                await self.cache.refresh(not_before=called_at)
                placed = self._place(demands, chosen_mode, excluded)
            if isinstance(placed, Refusal):
                await self._count_refused(Phase.PREFILL)
                raise SloRefusalError(
                    f"request {request_id!r} (prompt {prompt_tokens}) refused: predicted time to "
                    f"first token {placed.best_ttft_s:.2f} s on every worker exceeds the "
                    f"{placed.slo_s:g} s SLO (best: {placed.details})"
                )
            if isinstance(placed, str):
                await self._count_refused(Phase(placed))
                raise capacity_error(
                    self.cache.views.values(), excluded, _GONE, self.limits,
                    request_id, prompt_tokens, max_tokens, placed,
                )  # fmt: skip
            plan = placed.plan
            parts = [
                ReservationPart(view.id, ph, demands[ph].claim(view.info.block_size))
                for ph, view in zip(plan.phases, plan.workers, strict=True)
            ]
            try:
                async with contextlib.AsyncExitStack() as held:
                    for worker_id in sorted({p.worker_id for p in parts}):  # fixed order
                        await held.enter_async_context(self._commit_locks[worker_id])
                    committed = await self.ledger.reserve(
                        parts,
                        functools.partial(self._recheck, parts),
                        request_id=request_id,
                        tenant=tenant,
                        quota=self.quotas.of(tenant),
                    )
            except WatchError:
                self.conflicts += 1
                # Spread out the retries of schedulers that collided on the same worker.
                await asyncio.sleep(self._jitter.uniform(0.0, 0.001 * (attempt + 1)))
                continue
            except RecheckFailedError as rejected:
                excluded[rejected.worker_id] = rejected.reason
                continue
            for part in parts:
                self.cache.account(part.worker_id, part.claim)
            d = placed.decision
            logger.debug(
                "%s: %s (%s) on %s; prompt %d, cached %d, predicted TTFT colocated %s, "
                "disaggregated %s, stall %.3f s", request_id, plan.mode.value, d.reason.value,
                "+".join(v.id for v in plan.workers), d.prompt_tokens, d.cached_tokens,
                _seconds(d.colocated_ttft_s), _seconds(d.disaggregated_ttft_s), d.stall_s,
            )  # fmt: skip
            prefill = committed.workers[parts[0].worker_id]
            decode = committed.workers[parts[-1].worker_id]
            return Assignment(
                committed.reservation_id, prefill, decode, plan.mode, attempt, self.policy.name,
                committed.ttl_s, placed.decision,
            )  # fmt: skip
        reason = "; ".join(f"{w}: {r}" for w, r in excluded.items()) or "conflicts only"
        raise CapacityError(
            f"request {request_id!r} (prompt {prompt_tokens}, max_tokens {max_tokens}) not "
            f"placed after {self.max_retries + 1} attempts under contention; "
            f"last refusals: {reason}"
        )

    async def _count_refused(self, phase: Phase) -> None:
        """One more request refused for want of ``phase`` capacity (``KeySpace.refused``):
        only on refusals, so a cluster with room pays nothing for it."""
        await self.redis.hincrby(self.keys.refused, phase.value, 1)

    def _place(
        self, demands: Mapping[Phase, Demand], mode: Mode, excluded: Mapping[str, str]
    ) -> Placement | Refusal | str:
        """The placement on the cached view (``placement.Placer``)."""
        views = [v for v in self.cache.views.values() if v.id not in excluded]
        if set(demands) == {Phase.DECODE}:
            return self.placer.place_decode(views, demands[Phase.DECODE])
        return self.placer.place(views, demands, mode, arrivals_per_s=self.arrivals.rate())

    def _recheck(
        self, parts: Sequence[ReservationPart], fresh: Mapping[str, WorkerView | None]
    ) -> None:
        """Step 3: veto the commit if fresh data says a chosen worker cannot take its part."""
        fingerprint = None
        for part in reversed(parts):  # decode first: the prefill must match its model
            view = fresh[part.worker_id]
            if view is None:
                raise RecheckFailedError(part.worker_id, _EXPIRED)
            if stale(view):
                raise RecheckFailedError(part.worker_id, _STALE)
            why = ineligibility(view, part.phase, fingerprint) or shortfall(
                view, part.claim, self.limits
            )
            if why is not None:
                raise RecheckFailedError(part.worker_id, why)
            fingerprint = view.info.model_fingerprint
            # Refresh the cache entry with what we just read: it is newer than the cache.
            self.cache.views[part.worker_id] = view

    # -- bookkeeping ---------------------------------------------------------------------------

    async def release(self, reservation_id: str, *, prefill_only: bool = False) -> bool:
        """Give the reserved capacity back; False if it was already released or expired.

        This replica's cache forgets the claim at once (a follow-up request finds the worker
        as free as it is); the other replicas' at their next refresh.
        """
        with _redis_reachable():
            return await self.ledger.release(
                reservation_id, prefill_only=prefill_only, on_released=self.cache.unaccount
            )

    async def renew(self, reservation_id: str) -> float:
        """Extend the reservation to ``reservation_ttl_s`` from now; returns that TTL.

        Raises UnknownRequestError (NOT_FOUND) if the reservation is gone.
        """
        with _redis_reachable():
            return await self.ledger.renew(reservation_id)
