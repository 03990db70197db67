"""Where a prefill worker may send KV: only to the decode worker its request's reservation
holds.

A ``Prefill`` call names the decode worker (``decode_address``) the prefill worker then
connects to: to ask which prompt blocks it caches, to stream a ``direct`` hand-off into it,
to announce a hand-off (``Decode.Prefetch``). Taken on trust, that would let whoever can call
``Prefill`` make the worker send KV (and connections) to any host and port. So a worker in a
cluster (one with Redis) checks the address against the scheduler's own record of the
reservation (``{ns}:reservation:{id}``, written by ``Scheduler.Assign`` with the reserved
workers' addresses from their heartbeats): one GET per request, no secret to share, and
sound as long as only cluster members can write Redis (AUTH). An address that does not match
(or no reservation, or Redis unreachable) is not used: the hand-off goes through the KV
store, which the worker was configured with, and the request still completes.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import RedisError

from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.reservations import assigned_decode_addresses


class AssignedDecode:
    """Checks ``Prefill`` calls' decode addresses against their reservations (module doc)."""

    def __init__(self, redis: Redis, keys: KeySpace) -> None:
        self.redis = redis
        self.keys = keys
        self.refused = 0
        """Decode addresses not used because they were not the reservation's."""

    async def refusal(self, reservation_id: str, decode_address: str) -> str | None:
        """None if ``reservation_id`` reserved the decode worker at ``decode_address``, else
        why the address must not be used."""
        why = await self._why_not(reservation_id, decode_address)
        if why is not None:
            self.refused += 1
        return why

    async def _why_not(self, reservation_id: str, decode_address: str) -> str | None:
        if not reservation_id:
            return "no reservation names it"
        try:
            addresses = await assigned_decode_addresses(self.redis, self.keys, reservation_id)
        except RedisError as err:
            return f"its reservation could not be read: {err}"
        if addresses is None:
            return f"reservation {reservation_id!r} is unknown or expired"
        if decode_address not in addresses:
            return f"reservation {reservation_id!r} holds another decode worker"
        return None

    async def close(self) -> None:
        await self.redis.aclose()
