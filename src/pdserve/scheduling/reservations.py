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
* Members the worker lists in its heartbeat (``WorkerInfo.reservations``, requests it has
  admitted) are already part of its free-block and queue figures and are not counted again.
* The sorted set's own key expiry is kept at or after its latest member's expiry, so the key
  never disappears while it holds a live reservation, and a dead worker's set goes away.
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

    def __init__(self, redis: Redis, keys: KeySpace, *, ttl_s: float = 120.0) -> None:
        if not ttl_s > 0:
            raise InvalidArgumentError("reservation_ttl_s", f"must be > 0, got {ttl_s}")
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s

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
    ) -> Committed:
        """Re-read the workers under WATCH, let ``check`` veto, then commit atomically.

        ``check`` gets a fresh view per worker (None when its heartbeat has expired) and raises
        RecheckFailedError to refuse. Raises WatchError when another client changed a watched
        key in between: nothing was written, and the caller may retry with fresh state.
        """
        worker_ids = list(dict.fromkeys(p.worker_id for p in parts))
        heartbeat_keys = [self.keys.worker(w) for w in worker_ids]
        resv_keys = [self.keys.reservations_on(w) for w in worker_ids]
        rid = uuid.uuid4().hex
        async with self.redis.pipeline(transaction=True) as pipe:
            # WATCH and the re-reads in one round trip, the commit in a second one.
            scores = {"withscores": True, "score_cast_func": float}
            raws, *entry_replies, (seconds, micros) = await _watch_and_read(
                pipe,
                [*heartbeat_keys, *resv_keys],
                [
                    (("MGET", *heartbeat_keys), {}),
                    *((("ZRANGE", k, 0, -1, "WITHSCORES"), scores) for k in resv_keys),
                    (("TIME",), {}),
                ],
            )
            entries = [_scored(e) for e in entry_replies]
            now_ms = _time_ms(seconds, micros)
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
            }
            pipe.multi()
            for key, ent, wid in zip(resv_keys, entries, worker_ids, strict=True):
                pipe.zremrangebyscore(key, "-inf", now_ms)
                pipe.zadd(key, {members[wid]: expiry_ms})
                latest = max([expiry_ms, *(score for _, score in ent)])
                pipe.pexpireat(key, int(latest) + _KEY_EXPIRY_SLACK_MS)
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
                pipe.multi()
                for key, member in drops:
                    pipe.zrem(key, member)
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
        """Push the reservation's expiry to now + TTL; return the TTL in seconds.

        Raises UnknownRequestError if it was released or has already expired.
        """
        record_key = self.keys.reservation(reservation_id)
        for _ in range(_MAX_BOOKKEEPING_RETRIES):
            async with self.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(record_key)
                raw = await pipe.get(record_key)
                if raw is None:
                    raise UnknownRequestError(f"reservation {reservation_id} is unknown or expired")
                parts = json.loads(raw)["parts"]
                resv_keys = [self.keys.reservations_on(wid) for wid, _, _ in parts]
                await pipe.watch(*resv_keys)
                now_ms = await _redis_now_ms(pipe)
                expiry_ms = now_ms + self.ttl_s * 1000.0
                latest: list[float] = []
                for key, (_, _, member) in zip(resv_keys, parts, strict=True):
                    score = await pipe.zscore(key, member)
                    if score is None or score <= now_ms:
                        raise UnknownRequestError(f"reservation {reservation_id} has expired")
                    top = _scored(await pipe.zrange(key, -1, -1, withscores=True))
                    latest.append(max([expiry_ms, *(s for _, s in top)]))
                pipe.multi()
                pipe.pexpire(record_key, round(self.ttl_s * 1000))
                for key, (_, _, member), last in zip(resv_keys, parts, latest, strict=True):
                    pipe.zadd(key, {member: expiry_ms}, xx=True)
                    pipe.pexpireat(key, int(last) + _KEY_EXPIRY_SLACK_MS)
                try:
                    await pipe.execute()
                except WatchError:
                    continue
                return self.ttl_s
        raise WatchError(f"reservation {reservation_id}: too many concurrent updates")
