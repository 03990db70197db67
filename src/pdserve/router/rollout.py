"""Gray rollout: which serving mode each request is sent in, as a split the routers share.

The split lives in Redis (``{ns}:rollout``, JSON) so that every router follows one setting
and one command shifts or rolls it back (``pdserve rollout``, ``rollout_cli``). It names a
share of requests per *arm* (a serving mode: ``disaggregated``, ``colocated`` or
``conditional``), the arm the rest goes to, and arms pinned per tenant::

    {"shares": {"disaggregated": 10.0}, "rest": "colocated",
     "tenants": {"acme": "conditional"}, "version": 3}

A request's arm: its tenant's pinned arm if any; else its request id hashed to a point in
[0, 100) (``bucket``: stable, so one request id always lands in the same arm, on every router),
the arms' shares laid end to end in name order, and past them the rest. No split in Redis:
the router's own ``--mode``.

``RolloutFollower`` keeps a router's copy current: it reads the key at start, again on each
message of the ``{ns}:rollout:changed`` channel (``set`` publishes one), and every
``poll_s`` in case a message was missed; an unreadable value is logged and the last good
split kept. Per-arm metrics (``pdserve_arm_*``) and the ``pdserve.arm`` span attribute tell
the arms apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.keys import KeySpace
from pdserve.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

ARMS = ("disaggregated", "colocated", "conditional")


def bucket(request_id: str) -> float:
    """A stable point in [0, 100) for ``request_id``."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 * 100.0


def _arm(value: object, field: str) -> str:
    if value not in ARMS:
        raise InvalidArgumentError(field, f"unknown arm {value!r}; one of {ARMS}")
    return str(value)


@dataclass(frozen=True, slots=True)
class Rollout:
    """A traffic split (see the module docstring)."""

    shares: Mapping[str, float] = field(default_factory=dict)
    """Arm -> percent of requests (0..100, summing to at most 100)."""
    rest: str = "colocated"
    tenants: Mapping[str, str] = field(default_factory=dict)
    """Tenant -> the arm all its requests go to."""
    version: int = 0

    def __post_init__(self) -> None:
        for arm, share in self.shares.items():
            _arm(arm, "shares")
            if isinstance(share, bool) or not isinstance(share, int | float) or share < 0:
                raise InvalidArgumentError("shares", f"{arm}: must be a percent >= 0, got {share}")
        if sum(self.shares.values()) > 100.0 + 1e-9:
            raise InvalidArgumentError("shares", f"add up to {sum(self.shares.values())}% > 100%")
        _arm(self.rest, "rest")
        for tenant, arm in self.tenants.items():
            _arm(arm, f"tenants.{tenant}")

    def arm(self, request_id: str, tenant: str = "") -> str:
        """The arm of one request."""
        pinned = self.tenants.get(tenant)
        if pinned is not None:
            return pinned
        point, edge = bucket(request_id), 0.0
        for arm in sorted(self.shares):
            edge += self.shares[arm]
            if point < edge:
                return arm
        return self.rest

    def to_json(self) -> str:
        return json.dumps(
            {"shares": dict(self.shares), "rest": self.rest, "tenants": dict(self.tenants),
             "version": self.version},
            sort_keys=True,
        )  # fmt: skip

    @classmethod
    def from_json(cls, raw: str | bytes) -> Rollout:
        try:
            data: Any = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InvalidArgumentError("rollout", f"not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise InvalidArgumentError("rollout", "must be a JSON object")
        shares, tenants = data.get("shares", {}), data.get("tenants", {})
        if not isinstance(shares, dict) or not isinstance(tenants, dict):
            raise InvalidArgumentError("rollout", "shares and tenants must be objects")
        return cls(shares, data.get("rest", "colocated"), tenants, int(data.get("version", 0)))

    def describe(self) -> str:
        """One line: the split in words."""
        parts = [f"{arm}={share:g}%" for arm, share in sorted(self.shares.items())]
        rest = 100.0 - sum(self.shares.values())
        parts.append(f"rest ({rest:g}%) {self.rest}")
        parts += [f"tenant {t}: {a}" for t, a in sorted(self.tenants.items())]
        return f"version {self.version}: " + ", ".join(parts)


def parse_shares(specs: list[str]) -> dict[str, float]:
    """``["disaggregated=10%", "conditional=5"]`` -> ``{"disaggregated": 10.0, ...}``."""
    shares: dict[str, float] = {}
    for spec in specs:
        arm, sep, value = spec.partition("=")
        if not sep:
            raise InvalidArgumentError("share", f"expected ARM=PERCENT, got {spec!r}")
        try:
            shares[_arm(arm, "share")] = float(value.removesuffix("%"))
        except ValueError:
            raise InvalidArgumentError("share", f"{spec!r}: not a percent") from None
    return shares


async def read_rollout(redis: Redis, keys: KeySpace) -> Rollout | None:
    raw = await redis.get(keys.rollout)
    return None if raw is None else Rollout.from_json(raw)


async def write_rollout(redis: Redis, keys: KeySpace, rollout: Rollout | None) -> Rollout | None:
    """Store ``rollout`` (None: remove the split) with the next version, and tell the
    routers. Returns what was stored."""
    current = await read_rollout(redis, keys)
    version = (current.version if current is not None else 0) + 1
    stored = None
    async with redis.pipeline(transaction=True) as pipe:
        if rollout is None:
            pipe.delete(keys.rollout)
        else:
            stored = Rollout(rollout.shares, rollout.rest, rollout.tenants, version)
            pipe.set(keys.rollout, stored.to_json())
        pipe.publish(keys.rollout_channel, str(version))
        await pipe.execute()
    return stored


class RolloutFollower:
    """A router's current copy of the split (see the module docstring)."""

    POLL_S = 5.0

    def __init__(self, redis: Redis, keys: KeySpace) -> None:
        self.redis = redis
        self.keys = keys
        self.current: Rollout | None = None
        self.reads = 0

    def arm(self, request_id: str, tenant: str) -> str | None:
        """The request's arm, or None when no split is set (the router's own mode)."""
        return self.current.arm(request_id, tenant) if self.current is not None else None

    async def refresh(self) -> None:
        try:
            self.current = await read_rollout(self.redis, self.keys)
        except InvalidArgumentError as err:
            logger.error("ignoring an unreadable rollout (keeping the last one): %s", err)
        self.reads += 1

    async def run(self) -> None:
        """Follow the split until cancelled."""
        while True:
            try:
                async with self.redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.keys.rollout_channel)
                    await self.refresh()  # after subscribing: no change slips in between
                    while True:
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=self.POLL_S
                        )
                        await self.refresh()  # on a message, or after POLL_S without one
                        del message
            except (RedisError, OSError) as err:
                logger.warning("following the rollout failed, retrying: %s", err)
                await asyncio.sleep(self.POLL_S)  # a retry timer


@contextlib.asynccontextmanager
async def following(follower: RolloutFollower) -> AsyncIterator[RolloutFollower]:
    """Run ``follower`` while inside (one task, cancelled on the way out)."""
    try:
        await follower.refresh()
    except (RedisError, OSError) as err:  # the task keeps trying; the router's mode meanwhile
        logger.warning("cannot read the rollout yet: %s", err)
    task = asyncio.create_task(follower.run(), name="rollout-follow")
    try:
        yield follower
    finally:
        await cancel_and_wait(task)  # its pub/sub read may swallow one cancel
