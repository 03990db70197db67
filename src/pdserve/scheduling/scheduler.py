"""ClusterScheduler: picks the workers for a request and reserves capacity on them.

Lifecycle of one ``assign()``:

1. Decide from the cache. The scheduler keeps a view of every live worker (heartbeat plus
   reserved amounts) that is at most ``refresh_interval_s`` old, so a decision costs no Redis
   round trip to *choose* (the service refreshes it in the background, ``refresher``; without
   that, the decision that finds it too old refreshes it first). The view leaves out workers
   whose heartbeat is more than two of their intervals old (gone, though their key may live
   on). It drops workers that are draining, of the wrong role, excluded by the caller (they
   failed this request) or earlier in this call, or too full on that view, and lets the
   placement policy order the rest: a decode worker (the scarce KV blocks) first, then a
   prefill worker with the same model fingerprint; or a single mixed worker in colocated
   mode; or a decode worker alone for a request migrating from a dead one (``decode_only``).
   If nothing fits, the view is refreshed once before refusing, so a refusal is never based
   on data older than the call.
2. Take this process's commit lock of each chosen worker (so a replica's own concurrent
   assigns queue instead of invalidating each other), then WATCH the chosen workers'
   heartbeat keys and reservation sets.
3. Re-check on fresh data read under the WATCH: each worker is alive (its key exists and its
   heartbeat is not stale), not draining, both workers have the same model fingerprint, and
   each has room for this request on top of the live reservations it has not admitted yet
   (decode: ceil((prompt + max_tokens) / block_size) blocks <= free - reserved; prefill:
   pending + prompt tokens within its queue limit; see ``capacity.shortfall``).
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
   released expire after ``reservation_ttl_s`` and stop counting; none is renewed past
   ``reservation_max_lifetime_s`` after its creation.

Tenants: with ``quotas`` (``quotas.TenantQuotas``), step 4 also counts the tenant's live
reservations under the same WATCH and refuses one past its quota (``QuotaExceededError``,
RESOURCE_EXHAUSTED naming the quota).

Because step 4 commits only if nothing it read in step 3 changed, any number of scheduler
replicas can share one Redis without over-committing a worker.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import WatchError

from pdserve.errors import CapacityError, InvalidArgumentError, WorkerUnavailableError
from pdserve.scheduling.capacity import (
    CapacityLimits,
    Claim,
    Demand,
    Phase,
    WorkerView,
    ineligibility,
    shortfall,
    stale,
)
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.policies import PlacementPolicy, make_policy
from pdserve.scheduling.quotas import TenantQuotas
from pdserve.scheduling.registry import RedisWorkerRegistry
from pdserve.scheduling.reservations import (
    RecheckFailedError,
    ReservationLedger,
    ReservationPart,
)
from pdserve.scheduling.worker_info import WorkerInfo

_EXPIRED = "heartbeat expired"
_STALE = "heartbeat stale"
_EXCLUDED = "excluded by the caller"
_GONE = (_EXPIRED, _STALE, _EXCLUDED)


@contextlib.contextmanager
def _redis_reachable() -> Iterator[None]:
    """Report an unreachable Redis as UNAVAILABLE, not as an internal error."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as err:
        raise WorkerUnavailableError(f"Redis unreachable: {err}") from err


class Mode(StrEnum):
    """How a request is served."""

    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


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
        quotas: TenantQuotas | None = None,
        reservation_max_lifetime_s: float = 3600.0,
    ) -> None:
        if not refresh_interval_s >= 0:
            raise InvalidArgumentError(
                "refresh_interval_s", f"must be >= 0, got {refresh_interval_s}"
            )
        if not isinstance(max_retries, int) or max_retries < 0:
            raise InvalidArgumentError(
                "max_retries", f"must be an integer >= 0, got {max_retries!r}"
            )
        self.keys = keys or KeySpace()
        self.registry = RedisWorkerRegistry(redis, keys=self.keys)
        self.ledger = ReservationLedger(
            redis,
            self.keys,
            ttl_s=reservation_ttl_s,
            max_lifetime_s=max(reservation_max_lifetime_s, reservation_ttl_s),
        )
        self.quotas = quotas or TenantQuotas()
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.refresh_interval_s = refresh_interval_s
        self.max_retries = max_retries
        self.limits = limits or CapacityLimits()
        self.default_mode = Mode(default_mode)
        # Plain counters; the metrics module exports them.
        self.decisions = 0
        """Assignments committed."""
        self.rejections = 0
        """assign() calls that ended in CapacityError or WorkerUnavailableError."""
        self.conflicts = 0
        """Commits aborted by WatchError (another writer got there first)."""
        self.retries = 0
        """Attempts after the first, for any reason."""
        self.refreshes = 0
        """Cache refreshes from Redis."""
        self._views: dict[str, WorkerView] = {}
        self._refreshed_at = -float("inf")  # time.monotonic() when the refresh started
        self._refresh_lock = asyncio.Lock()
        # One commit at a time per worker *within this process*: concurrent assigns of one
        # replica would otherwise invalidate each other's WATCH and burn their retries. WATCH
        # still arbitrates between replicas.
        self._commit_locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._jitter = random.Random()

    # -- cache ---------------------------------------------------------------------------------

    async def snapshot(self, *, max_age_s: float | None = None) -> list[WorkerView]:
        """The cached view of live workers, refreshed first if older than ``max_age_s``
        (default ``refresh_interval_s``)."""
        limit = self.refresh_interval_s if max_age_s is None else max_age_s
        with _redis_reachable():
            await self._refresh(not_before=time.monotonic() - limit)
        return sorted(self._views.values(), key=lambda v: v.id)

    async def refresh(self) -> None:
        """Refresh the cached view from Redis now (``refresher.kept_fresh`` calls it)."""
        await self._refresh(not_before=time.monotonic())

    async def _refresh(self, *, not_before: float) -> None:
        # Single flight: concurrent callers wait for one refresh instead of each doing one.
        if self._refreshed_at >= not_before:
            return
        async with self._refresh_lock:
            if self._refreshed_at >= not_before:
                return
            started = time.monotonic()
            infos = await self.registry.list_workers()
            reserved, now_s = await self.ledger.reserved_on(infos)
            views = (WorkerView(i, reserved[i.id], max(0.0, now_s - i.ts)) for i in infos)
            # A worker two heartbeats late is gone, even while its key lives on.
            self._views = {v.id: v for v in views if not stale(v)}
            self._refreshed_at = started
            self.refreshes += 1

    def _account(self, worker_id: str, claim: Claim) -> None:
        """Add our own commit to the cache so that the next decisions see it at once."""
        view = self._views.get(worker_id)
        if view is not None:
            self._views[worker_id] = view.with_reserved(view.reserved + claim)

    # -- decisions -----------------------------------------------------------------------------

    async def assign(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        *,
        mode: Mode | None = None,
        tenant: str = "",
        exclude: Sequence[str] = (),
        decode_only: bool = False,
    ) -> Assignment:
        """Choose workers for a request and reserve capacity on them (see module docstring).

        ``mode`` None takes ``default_mode``. ``tenant``'s quota caps its live reservations
        (``QuotaExceededError``); no placement policy uses the tenant yet. ``exclude``: worker
        ids not to choose (they failed this request). ``decode_only``: reserve a decode worker
        alone (a migration; it recomputes the prompt), named as ``prefill`` too; colocated
        mode ignores it.
        """
        with _redis_reachable():
            return await self._assign(
                request_id, prompt_tokens, max_tokens, mode, tenant, exclude, decode_only
            )

    async def _assign(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        mode: Mode | None,
        tenant: str,
        exclude: Sequence[str],
        decode_only: bool,
    ) -> Assignment:
        chosen_mode = self.default_mode if mode is None else Mode(mode)
        if chosen_mode is Mode.COLOCATED:
            phases: tuple[Phase, ...] = (Phase.COLOCATED,)
        else:
            phases = (Phase.DECODE,) if decode_only else (Phase.PREFILL, Phase.DECODE)
        demands = {ph: Demand(prompt_tokens, max_tokens, ph) for ph in phases}
        # worker id -> why it is out of this call (the caller's word, or a failed re-check)
        excluded: dict[str, str] = dict.fromkeys(exclude, _EXCLUDED)
        called_at = time.monotonic()
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retries += 1
            # A retry means our view was wrong somewhere: decide on data newer than the failure.
            not_before = time.monotonic() - (0.0 if attempt else self.refresh_interval_s)
            await self._refresh(not_before=not_before)
            pick = self._pick(demands, excluded)
            if isinstance(pick, str) and self._refreshed_at < called_at:
                # Refuse only on data newer than the call: capacity may have just been freed.
                await self._refresh(not_before=called_at)
                pick = self._pick(demands, excluded)
            if isinstance(pick, str):
                self.rejections += 1
                raise self._no_capacity(request_id, prompt_tokens, max_tokens, pick, excluded)
            parts = [
                ReservationPart(view.id, ph, demands[ph].claim(view.info.block_size))
                for ph, view in zip(phases, pick, strict=True)
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
                self._account(part.worker_id, part.claim)
            self.decisions += 1
            prefill = committed.workers[parts[0].worker_id]
            decode = committed.workers[parts[-1].worker_id]
            return Assignment(
                committed.reservation_id,
                prefill,
                decode,
                chosen_mode,
                attempt,
                self.policy.name,
                committed.ttl_s,
            )
        self.rejections += 1
        reason = "; ".join(f"{w}: {r}" for w, r in excluded.items()) or "conflicts only"
        raise CapacityError(
            f"request {request_id!r} (prompt {prompt_tokens}, max_tokens {max_tokens}) not "
            f"placed after {self.max_retries + 1} attempts under contention; "
            f"last refusals: {reason}"
        )

    def _pick(
        self, demands: Mapping[Phase, Demand], excluded: Mapping[str, str]
    ) -> tuple[WorkerView, ...] | str:
        """Workers for each phase (in ``demands`` order), or why there are none."""
        views = [v for v in self._views.values() if v.id not in excluded]
        if Phase.COLOCATED in demands:
            best = self._ranked(views, demands[Phase.COLOCATED], None)
            return (best[0],) if best else Phase.COLOCATED.value
        decodes = self._ranked(views, demands[Phase.DECODE], None)
        if Phase.PREFILL not in demands:  # decode only: the worker recomputes the prompt
            return (decodes[0],) if decodes else Phase.DECODE.value
        for decode in decodes:
            fingerprint = decode.info.model_fingerprint
            prefills = self._ranked(views, demands[Phase.PREFILL], fingerprint)
            if prefills:
                return prefills[0], decode
        return (Phase.PREFILL if decodes else Phase.DECODE).value

    def _ranked(
        self, views: Sequence[WorkerView], demand: Demand, fingerprint: str | None
    ) -> list[WorkerView]:
        fitting = [
            v
            for v in views
            if ineligibility(v, demand.phase, fingerprint) is None
            and shortfall(v, demand.claim(v.info.block_size), self.limits) is None
        ]
        return self.policy.choose(fitting, demand) if fitting else []

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
            self._views[part.worker_id] = view

    def _no_capacity(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        phase: str,
        excluded: Mapping[str, str],
    ) -> CapacityError | WorkerUnavailableError:
        role = Phase(phase).role
        alive = [
            v
            for v in self._views.values()
            if v.info.role is role and not v.info.draining and excluded.get(v.id) not in _GONE
        ]
        what = f"request {request_id!r} (prompt {prompt_tokens}, max_tokens {max_tokens})"
        if not alive:
            return WorkerUnavailableError(f"{what}: no live, non-draining {role.value} worker")
        details = "; ".join(
            f"{v.id}: {excluded.get(v.id) or self._why_not(v, phase, prompt_tokens, max_tokens)}"
            for v in sorted(alive, key=lambda v: v.id)
        )
        return CapacityError(f"{what}: every {role.value} worker is full ({details})")

    def _why_not(self, view: WorkerView, phase: str, prompt_tokens: int, max_tokens: int) -> str:
        claim = Demand(prompt_tokens, max_tokens, Phase(phase)).claim(view.info.block_size)
        if phase == Phase.PREFILL:
            fallback = "its model differs from every decode worker with room"
        else:
            fallback = "no prefill worker with its model has room"
        return shortfall(view, claim, self.limits) or fallback

    # -- bookkeeping ---------------------------------------------------------------------------

    async def release(self, reservation_id: str, *, prefill_only: bool = False) -> bool:
        """Give the reserved capacity back; False if it was already released or expired.

        The cache is corrected by the next refresh (at most ``refresh_interval_s`` later).
        """
        with _redis_reachable():
            return await self.ledger.release(reservation_id, prefill_only=prefill_only)

    async def renew(self, reservation_id: str) -> float:
        """Extend the reservation to ``reservation_ttl_s`` from now; returns that TTL.

        Raises UnknownRequestError (NOT_FOUND) if the reservation is gone.
        """
        with _redis_reachable():
            return await self.ledger.renew(reservation_id)
