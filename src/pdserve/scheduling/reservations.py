"""The reservation ledger: capacity promised to requests, kept in Redis, expiring by itself.

Design. Each worker has a sorted set ``{ns}:resv:{worker_id}`` whose members encode one
reservation each, ``{reservation_id}|{tokens}|{blocks}``, scored by the reservation's expiry
time in milliseconds of *Redis* time (``TIME``), so every scheduler replica agrees on the clock.

* A reservation counts while its score is in the future. An expired member (its scheduler or
  router died without releasing) stops counting the moment it expires, even before anyone
  removes it; commits prune expired members (ZREMRANGEBYSCORE) inside their MULTI/EXEC.
* Reading the reserved total of a worker is one ZRANGE, and it is consistent with the worker's
  heartbeat under the same WATCH, which is what makes the optimistic re-check sound: the commit
  of a competing scheduler modifies the sorted set and aborts ours (WatchError).
* A record ``{ns}:reservation:{id}`` (PX TTL = the reservation's) lists the members, so that
  release and renew find them without scanning; it expires together with the members.
* A reservation's id is random (``uuid4``), never derived from the request's: callers choose
  request ids, and one tenant's id must not name, renew or release another's reservation. The
  record keeps the request id it was asked for (the router's per-tenant ``scoped_id``,
  ``pdserve.request_key``), for the logs only.
* Members the worker lists in its heartbeat (``WorkerInfo.reservations``, requests it has
  admitted) are already part of its free-block and queue figures and are not counted again.
* The sorted set's own key expiry is kept at or after its latest member's expiry, so the key
  never disappears while it holds a live reservation, and a dead worker's set goes away.
* The record also keeps the reserved workers' addresses (a prefill worker pushes KV only to
  the decode address of its request's reservation: ``assigned_decode_addresses``), the tenant
  and the creation time: ``renew`` never extends a reservation past ``max_lifetime_s`` from
  its creation, so nobody can hold capacity forever by renewing.
* A tenant with a quota (``quotas.TenantQuota``) has a sorted set ``{ns}:tenant:{tenant}`` of
  ``{reservation_id}|{blocks}`` (the decode or colocated share's KV blocks) scored like the
  workers' members; ``reserve`` reads it under the same WATCH and refuses a reservation past
  the quota (``QuotaExceededError``) before anything is written.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

from pdserve.errors import InvalidArgumentError, UnknownRequestError
from pdserve.quotas import QuotaExceededError, TenantQuota
from pdserve.scheduling.capacity import Claim, Phase, WorkerView
from pdserve.scheduling.keys import KeySpace, text
from pdserve.scheduling.worker_info import WorkerInfo

_KEY_EXPIRY_SLACK_MS = 1000
_MAX_BOOKKEEPING_RETRIES = 16  # release/renew only conflict with each other; retry freely


@dataclass(frozen=True, slots=True)
class ReservationPart:
    """What one reservation holds on one worker."""

    worker_id: str
    phase: Phase
    claim: Claim


@dataclass(frozen=True, slots=True)
class Committed:
    """A reservation that EXEC stored, with the worker states it was checked against."""

    reservation_id: str
    workers: Mapping[str, WorkerInfo]
    ttl_s: float


class RecheckFailedError(Exception):
    """The re-check under WATCH found a worker unfit; the scheduler tries another."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(f"worker {worker_id}: {reason}")
        self.worker_id = worker_id
        self.reason = reason


def encode_member(reservation_id: str, claim: Claim) -> str:
    return f"{reservation_id}|{claim.tokens}|{claim.blocks}"


def decode_member(member: str | bytes) -> tuple[str, Claim]:
    """Inverse of ``encode_member``."""
    rid, tokens, blocks = text(member).rsplit("|", 2)
    return rid, Claim(int(tokens), int(blocks))


def live_claims(
    entries: Sequence[tuple[str | bytes, float]], now_ms: float, admitted: Sequence[str] = ()
) -> Claim:
    """Sum of the (member, expiry_ms) entries still alive at ``now_ms`` and not yet admitted."""
    skip = set(admitted)
    total = Claim()
    for member, expiry_ms in entries:
        rid, claim = decode_member(member)
        if expiry_ms > now_ms and rid not in skip:
            total = total + claim
    return total


def _scored(reply: object) -> list[tuple[str | bytes, float]]:
    """Type a ZRANGE ... WITHSCORES reply (redis-py gives (member, score) pairs)."""
    return cast(list[tuple[str | bytes, float]], reply)


def _time_ms(seconds: int | str | bytes, micros: int | str | bytes) -> float:
    """Redis ``TIME``'s reply (seconds, microseconds) in milliseconds."""
    return int(seconds) * 1000.0 + int(micros) / 1000.0


async def _redis_now_ms(pipe: Redis | Pipeline) -> float:
    return _time_ms(*await pipe.time())


_Read = tuple[tuple[str | int, ...], dict[str, object]]
"""One read for ``_watch_and_read``: the command's arguments and its reply options."""


async def _watch_and_read(
    pipe: Pipeline, watch: Sequence[str], reads: Sequence[_Read]
) -> list[Any]:
    """WATCH ``watch`` and run ``reads`` (``(command args, reply options)``) in one round trip.

    Redis runs a connection's commands in order, so the reads see the state the WATCH guards,
    exactly as if each had been sent on its own; only the waiting between them is saved. The
    replies go through the pipeline's own reply parsing. Afterwards the pipeline is WATCHing
    on its connection as after ``pipe.watch()``: ``multi()`` / ``execute()`` commit (or raise
    WatchError), and leaving its ``async with`` block unwatches and returns the connection.
    """
    conn = pipe.connection
    if conn is None:
        conn = pipe.connection = await pipe.connection_pool.get_connection()
    try:
        await conn.send_packed_command(
            conn.pack_commands([("WATCH", *watch), *(args for args, _ in reads)])
        )
        await pipe.parse_response(conn, "WATCH")  # marks the pipeline as watching
        return [await pipe.parse_response(conn, str(args[0]), **opts) for args, opts in reads]
    except BaseException:
        # Replies may be left unread on the connection: it cannot be reused.
        pipe.watching = False
        await conn.disconnect()
        raise


_HOLDING_PHASES = (Phase.DECODE, Phase.COLOCATED)
"""The shares whose KV blocks a tenant's quota counts, and whose worker may receive KV."""


async def assigned_decode_addresses(
    redis: Redis, keys: KeySpace, reservation_id: str
) -> frozenset[str] | None:
    """The addresses of the decode (or mixed) workers ``reservation_id`` reserved; None if
    the reservation is unknown, released or expired (one GET)."""
    if not reservation_id:
        return None
    raw = await redis.get(keys.reservation(reservation_id))
    if raw is None:
        return None
    record = json.loads(raw)
    addresses: dict[str, str] = record.get("addresses", {})
    return frozenset(
        addresses[wid] for wid, phase, _ in record["parts"] if phase in _HOLDING_PHASES
    )


def _tenant_member(reservation_id: str, parts: Sequence[ReservationPart]) -> tuple[str, int]:
    blocks = sum(p.claim.blocks for p in parts if p.phase in _HOLDING_PHASES)
    return f"{reservation_id}|{blocks}", blocks


def _tenant_load(entries: Sequence[tuple[str | bytes, float]], now_ms: float) -> tuple[int, int]:
    """Live reservations and their blocks in a tenant's sorted set."""
    live = [text(m) for m, expiry_ms in entries if expiry_ms > now_ms]
    return len(live), sum(int(m.rsplit("|", 1)[1]) for m in live)


def _report_released(
    drops: Sequence[tuple[str, str]],
    rewrites: Sequence[tuple[str, str, str, float]],
    on_released: Callable[[str, Claim], None],
) -> None:
    """Tell ``on_released`` what each dropped or rewritten member gave back on its worker
    (the worker id is the tail of the member's sorted-set key)."""
    for key, member in drops:
        on_released(key.rsplit(":", 1)[1], decode_member(member)[1])
    for key, old, new, _ in rewrites:
        on_released(key.rsplit(":", 1)[1], decode_member(old)[1] - decode_member(new)[1])


class ReservationLedger:
    """Reads, commits, releases and renews reservations in one namespace."""

    def __init__(
        self,
        redis: Redis,
        keys: KeySpace,
        *,
        ttl_s: float = 120.0,
        max_lifetime_s: float = 3600.0,
    ) -> None:
        if not ttl_s > 0:
            raise InvalidArgumentError("reservation_ttl_s", f"must be > 0, got {ttl_s}")
        if not max_lifetime_s >= ttl_s:
            raise InvalidArgumentError(
                "reservation_max_lifetime_s",
                f"must be >= the TTL ({ttl_s}), got {max_lifetime_s}",
            )
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.max_lifetime_s = max_lifetime_s
        """No renewal extends a reservation past this long after its creation."""

    @staticmethod
    def _latest(expiry_ms: float, entries: Sequence[Sequence[tuple[str | bytes, float]]]) -> float:
        """When a sorted set holding ``entries`` and a member expiring at ``expiry_ms`` may
        go (its latest member's expiry, plus slack)."""
        scores = [score for entry in entries for _, score in entry]
        return max([expiry_ms, *scores]) + _KEY_EXPIRY_SLACK_MS

    async def reserved_on(self, workers: Sequence[WorkerInfo]) -> tuple[dict[str, Claim], float]:
        """Live, not-admitted reservations per worker, and Redis time in s (one round trip)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.time()
            for info in workers:
                pipe.zrange(self.keys.reservations_on(info.id), 0, -1, withscores=True)
            (seconds, micros), *entries = await pipe.execute()
        now_ms = _time_ms(seconds, micros)
        reserved = {
            info.id: live_claims(_scored(e), now_ms, info.reservations)
            for info, e in zip(workers, entries, strict=True)
        }
        return reserved, now_ms / 1000.0

    async def reserve(
        self,
        parts: Sequence[ReservationPart],
        check: Callable[[Mapping[str, WorkerView | None]], None],
        *,
        request_id: str = "",
        tenant: str = "",
        quota: TenantQuota | None = None,
    ) -> Committed:
        """Re-read the workers under WATCH, let ``check`` veto, then commit atomically.

        ``check`` gets a fresh view per worker (None when its heartbeat has expired) and raises
        RecheckFailedError to refuse. Raises WatchError when another client changed a watched
        key in between: nothing was written, and the caller may retry with fresh state. A
        ``quota`` that limits anything is checked on the tenant's live reservations read under
        the same WATCH (``QuotaExceededError``, nothing written).
        """
        worker_ids = list(dict.fromkeys(p.worker_id for p in parts))
        heartbeat_keys = [self.keys.worker(w) for w in worker_ids]
        resv_keys = [self.keys.reservations_on(w) for w in worker_ids]
        tenant_key = self.keys.tenant_reservations(tenant) if quota and quota.limited else None
        counted = [tenant_key] if tenant_key is not None else []
        rid = uuid.uuid4().hex
        async with self.redis.pipeline(transaction=True) as pipe:
            # WATCH and the re-reads in one round trip, the commit in a second one.
            scores = {"withscores": True, "score_cast_func": float}
            raws, *entry_replies, (seconds, micros) = await _watch_and_read(
                pipe,
                [*heartbeat_keys, *resv_keys, *counted],
                [
                    (("MGET", *heartbeat_keys), {}),
                    *((("ZRANGE", k, 0, -1, "WITHSCORES"), scores) for k in resv_keys),
                    *((("ZRANGE", k, 0, -1, "WITHSCORES"), scores) for k in counted),
                    (("TIME",), {}),
                ],
            )
            entries = [_scored(e) for e in entry_replies[: len(resv_keys)]]
            tenant_entries = [_scored(e) for e in entry_replies[len(resv_keys) :]]
            now_ms = _time_ms(seconds, micros)
            member, blocks = _tenant_member(rid, parts)
            if quota is not None and tenant_entries:
                refusal = quota.refusal(tenant, *_tenant_load(tenant_entries[0], now_ms), blocks)
                if refusal is not None:
                    raise QuotaExceededError(f"request {request_id!r}: {refusal}")
            views: dict[str, WorkerView | None] = {}
            for wid, raw, ent in zip(worker_ids, raws, entries, strict=True):
                if raw is None:
                    views[wid] = None
                    continue
                try:
                    info = WorkerInfo.from_json(raw)
                except InvalidArgumentError as err:
                    raise RecheckFailedError(wid, f"unreadable heartbeat: {err}") from err
                reserved = live_claims(ent, now_ms, info.reservations)
                views[wid] = WorkerView(info, reserved, max(0.0, now_ms / 1000.0 - info.ts))
            check(views)

            expiry_ms = now_ms + self.ttl_s * 1000.0
            members = {p.worker_id: encode_member(rid, p.claim) for p in parts}
            record = {
                "request_id": request_id,
                "parts": [[p.worker_id, p.phase.value, members[p.worker_id]] for p in parts],
                "addresses": {w: v.info.address for w, v in views.items() if v is not None},
                "tenant_key": tenant_key,
                "tenant_member": member,
                "created_ms": now_ms,
            }
            pipe.multi()
            for key, ent, wid in zip(resv_keys, entries, worker_ids, strict=True):
                pipe.zremrangebyscore(key, "-inf", now_ms)
                pipe.zadd(key, {members[wid]: expiry_ms})
                latest = max([expiry_ms, *(score for _, score in ent)])
                pipe.pexpireat(key, int(latest) + _KEY_EXPIRY_SLACK_MS)
            if tenant_key is not None:
                pipe.zremrangebyscore(tenant_key, "-inf", now_ms)
                pipe.zadd(tenant_key, {member: expiry_ms})
                pipe.pexpireat(tenant_key, int(self._latest(expiry_ms, tenant_entries)))
            pipe.set(self.keys.reservation(rid), json.dumps(record), px=round(self.ttl_s * 1000))
            await pipe.execute()
        infos = {wid: v.info for wid, v in views.items() if v is not None}
        return Committed(rid, infos, self.ttl_s)

    async def release(
        self,
        reservation_id: str,
        *,
        prefill_only: bool = False,
        on_released: Callable[[str, Claim], None] | None = None,
    ) -> bool:
        """Drop the reservation (or only its prefill share); False if it was already gone.

        The prefill share of a colocated reservation is its prompt tokens: the member is
        rewritten with tokens = 0 and the same expiry, keeping its blocks. ``on_released``
        gets each worker and the claim given back there, once committed.
        """
        record_key = self.keys.reservation(reservation_id)
        for _ in range(_MAX_BOOKKEEPING_RETRIES):
            async with self.redis.pipeline(transaction=True) as pipe:
                # WATCH and the read in one round trip, the commit in a second one.
                (raw,) = await _watch_and_read(pipe, [record_key], [(("GET", record_key), {})])
                if raw is None:
                    return False
                record = json.loads(raw)
                keep: list[list[str]] = []
                rewrites: list[tuple[str, str, str, float]] = []  # key, old, new, score
                drops: list[tuple[str, str]] = []
                for wid, phase, member in record["parts"]:
                    key = self.keys.reservations_on(wid)
                    if not prefill_only or phase == Phase.PREFILL:
                        drops.append((key, member))
                    elif phase == Phase.COLOCATED:
                        score = await pipe.zscore(key, member)
                        _, claim = decode_member(member)
                        new = encode_member(reservation_id, Claim(0, claim.blocks))
                        if score is not None and new != member:
                            rewrites.append((key, member, new, score))
                        keep.append([wid, phase, new])
                    else:
                        keep.append([wid, phase, member])
                if prefill_only and not drops and not rewrites:
                    return False
                tenant_key = record.get("tenant_key")
                pipe.multi()
                for key, member in drops:
                    pipe.zrem(key, member)
                if not keep and tenant_key:  # all of it goes: the tenant's count too
                    pipe.zrem(tenant_key, record["tenant_member"])
                for key, old, new, score in rewrites:
                    pipe.zrem(key, old)
                    pipe.zadd(key, {new: score})
                if keep:
                    record["parts"] = keep
                    pipe.set(record_key, json.dumps(record), keepttl=True)
                else:
                    pipe.delete(record_key)
                try:
                    await pipe.execute()
                except WatchError:
                    continue  # a concurrent renew/release touched the record; read it again
                if on_released is not None:
                    _report_released(drops, rewrites, on_released)
                return True
        raise WatchError(f"reservation {reservation_id}: too many concurrent updates")

    async def renew(self, reservation_id: str) -> float:
        """Push the reservation's expiry to now + TTL, but never past ``max_lifetime_s`` after
        its creation; return the seconds it now lives.

        Raises UnknownRequestError if it was released, has already expired, or has reached
        its maximum lifetime (it then expires when its current TTL runs out).
        """
        record_key = self.keys.reservation(reservation_id)
        for _ in range(_MAX_BOOKKEEPING_RETRIES):
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(record_key)
                raw = await pipe.get(record_key)
                if raw is None:
                    raise UnknownRequestError(f"reservation {reservation_id} is unknown or expired")
                record = json.loads(raw)
                parts = record["parts"]
                tenant_key = record.get("tenant_key")
                resv_keys = [self.keys.reservations_on(wid) for wid, _, _ in parts]
                await pipe.watch(*resv_keys)
                now_ms = await _redis_now_ms(pipe)
                created_ms = float(record.get("created_ms", now_ms))
                expiry_ms = min(
                    now_ms + self.ttl_s * 1000.0, created_ms + self.max_lifetime_s * 1000.0
                )
                if expiry_ms <= now_ms + 1.0:
                    raise UnknownRequestError(
                        f"reservation {reservation_id} reached its maximum lifetime of "
                        f"{self.max_lifetime_s:g} s; it is not renewed"
                    )
                latest: list[float] = []
                for key, (_, _, member) in zip(resv_keys, parts, strict=True):
                    score = await pipe.zscore(key, member)
                    if score is None or score <= now_ms:
                        raise UnknownRequestError(f"reservation {reservation_id} has expired")
                    top = _scored(await pipe.zrange(key, -1, -1, withscores=True))
                    latest.append(max([expiry_ms, *(s for _, s in top)]))
                pipe.multi()
                pipe.pexpireat(record_key, int(expiry_ms))
                for key, (_, _, member), last in zip(resv_keys, parts, latest, strict=True):
                    pipe.zadd(key, {member: expiry_ms}, xx=True)
                    pipe.pexpireat(key, int(last) + _KEY_EXPIRY_SLACK_MS)
                if tenant_key:
                    pipe.zadd(tenant_key, {record["tenant_member"]: expiry_ms}, xx=True)
                    # Every member expires within max_lifetime_s of now: so may the set.
                    pipe.expire(tenant_key, int(self.max_lifetime_s) + 60)
                try:
                    await pipe.execute()
                except WatchError:
                    continue
                return (expiry_ms - now_ms) / 1000.0
        raise WatchError(f"reservation {reservation_id}: too many concurrent updates")
