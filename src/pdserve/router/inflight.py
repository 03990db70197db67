"""The requests one router has in flight, by ``RequestKey`` (tenant and the caller's id).

A tenant's second request with the id of one of its requests still in flight is refused with
ALREADY_EXISTS before anything is placed: the two would share every key below the router (the
workers' sequences, the hand-off's shm segment) and the later one would fail there, after a
placement and a prefill. Another tenant's request with the same id is another key and runs
(``pdserve.request_key``).

A request's id is free again once its last chunk is made, before that chunk reaches the
caller: a caller that reuses an id as soon as it has its answer is not refused. Routers do not
share this set; behind several routers a duplicate that reaches a worker still holding the
first is refused there (the engines keep requests by the same scoped id).
"""

from __future__ import annotations

from pdserve.errors import DuplicateRequestError
from pdserve.request_key import RequestKey


class InFlightClaim:
    """One request's hold on its key; ``release()`` (idempotent) frees it."""

    __slots__ = ("_held", "key")

    def __init__(self, held: set[RequestKey], key: RequestKey) -> None:
        self._held: set[RequestKey] | None = held
        self.key = key

    def release(self) -> None:
        if self._held is not None:
            self._held.discard(self.key)
            self._held = None


class InFlight:
    """The keys of the requests in flight through one ``RequestFlow``."""

    def __init__(self) -> None:
        self._held: set[RequestKey] = set()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: RequestKey) -> bool:
        return key in self._held

    def claim(self, key: RequestKey) -> InFlightClaim:
        """Hold ``key`` until the claim is released; ``DuplicateRequestError`` (ALREADY_EXISTS)
        while another request holds it."""
        if key in self._held:
            raise DuplicateRequestError(
                f"request_id {key.request_id!r} is already in flight for this tenant"
            )
        self._held.add(key)
        return InFlightClaim(self._held, key)
