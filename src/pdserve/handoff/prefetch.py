"""Reads of hand-offs that begin before their ``Decode`` call (``Decode.Prefetch``).

Without them the decode worker learns of a ``store``, ``shm`` or ``nixl`` hand-off only from
the ``Decode`` call, after the prefill answered, and its whole read adds to the time before
decoding starts. With them:

  1. Announce (prefill): at ``begin``, as the layers start to leave, the prefill worker calls
     ``Decode.Prefetch`` with the location being written.
  2. Follow (decode): ``Prefetches.start`` runs the location's ``KVReceiver.receive`` as a task
     that follows the writer (a store ``Get`` with ``follow``, the shm segment's per-layer
     ready marks, or the nixl payload's, polled by small READs), checking each layer as it
     lands: the read overlaps the prefill's compute.
     The ``Prefetch`` call answers when the read has ended (its trace spans nest in the
     call's); the prefill worker's commit waits for that answer (bounded), so when the
     prefill answers, the decode worker holds the checked KV.
  3. Take (decode): the ``Decode`` call for the same request and location takes the read
     (``take``) and waits only for what may be left of it. A ``Decode`` call naming another
     location (the hand-off fell back to recompute, or went elsewhere) drops it instead.
  4. Drop: a read that no ``Decode`` call takes is cancelled and its transport's copy freed
     after ``TAKE_GRACE_S`` (``sweep``, or its own bound if it never ends), and all of them at
     ``close``. A ``Prefetch`` call cancelled by its caller (whose commit gave up waiting)
     stops the read and leaves the KV where it was (``cancel``): the ``Decode`` call reads it.

Every task is owned here: cancelled, awaited and discarded on every path; nothing leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from dataclasses import dataclass

from pdserve.engine.kv_payload import KVPayload
from pdserve.errors import PdServeError
from pdserve.transfer.base import KVLocation, KVReceiver, TransportKind

logger = logging.getLogger(__name__)

PREFETCHED = (TransportKind.STORE, TransportKind.SHM, TransportKind.NIXL)
"""What can be prefetched (``direct`` arrives in this worker's endpoint by itself)."""

TAKE_GRACE_S = 30.0
"""How long a finished read waits for its Decode call (which normally follows the prefill's
answer at once; a request that ended at its first token never sends one)."""

PREFETCH_TIMEOUT_S = 900.0
"""Bound on a read that follows a prefill: it lasts as long as the prompt's compute (minutes
for 32K tokens on a few CPU cores). A writer that gives up, stalls or dies ends it sooner:
its ``Prefetch`` call is cancelled (by its commit's timeout, its discard, or the dropped
connection of a dead process), which stops the read; a store write is also aborted once its
lease passes without progress, an shm writer marks its segment aborted, and a nixl writer's
blocks lose their tags."""


@dataclass(eq=False, slots=True)
class Prefetch:
    """One read started early: its receiver, the task running ``receive``, its expiry."""

    location: KVLocation
    receiver: KVReceiver
    task: asyncio.Task[KVPayload]
    expires_at: float
    """``time.monotonic``: dropped by ``sweep`` after this unless taken."""
    done_at: float = 0.0
    """``time.monotonic`` when the read ended (0: still reading)."""

    def expired(self, now: float) -> bool:
        """Past its read's bound, or ended and not taken within ``TAKE_GRACE_S``."""
        return now >= self.expires_at or (self.done_at > 0 and now >= self.done_at + TAKE_GRACE_S)

    def proven_by(self, location: KVLocation) -> bool:
        """Whether ``location`` carries this hand-off's capability (constant-time): only its
        holder may take or drop the read."""
        return hmac.compare_digest(self.location.capability, location.capability)

    def matches(self, location: KVLocation) -> bool:
        return _where(self.location) == _where(location) and self.proven_by(location)

    async def stop(self) -> None:
        """Cancel the read and wait for it, leaving the transport's copy where it is."""
        self.task.cancel()
        # Stopping: the read's own outcome no longer matters.
        with contextlib.suppress(asyncio.CancelledError, PdServeError):
            await self.task

    async def drop(self) -> None:
        """Stop the read and free the transport's copy."""
        await self.stop()
        await self.receiver.discard()


def _where(kv: KVLocation) -> tuple[object, ...]:
    """What names a hand-off's data (its prefix split aside)."""
    return (kv.kind, kv.key, kv.address, kv.host, kv.num_tokens, kv.generation)


class Prefetches:
    """The prefetches of one decode worker, by request id (see the module docstring)."""

    def __init__(self, *, max_pending: int = 256) -> None:
        self.max_pending = max_pending
        self._pending: dict[str, Prefetch] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, location: KVLocation, receiver: KVReceiver, timeout_s: float) -> bool:
        """Start reading ``location``; False (nothing started) for a request that already has
        one, or when ``max_pending`` are running (the ``Decode`` call reads it then)."""
        rid = location.request_id
        if rid in self._pending or len(self._pending) >= self.max_pending:
            return False
        task = asyncio.get_running_loop().create_task(
            receiver.receive(timeout_s), name=f"kv-prefetch-{rid}"
        )
        # The read is bounded by timeout_s; the grace covers a Decode call on its way.
        prefetch = Prefetch(location, receiver, task, time.monotonic() + timeout_s + TAKE_GRACE_S)
        task.add_done_callback(lambda _: setattr(prefetch, "done_at", time.monotonic()))
        self._pending[rid] = prefetch
        return True

    async def take(self, location: KVLocation) -> Prefetch | None:
        """The prefetch of ``location``'s request if it read that very location; one that
        read somewhere else is dropped (and None returned). A location without the hand-off's
        capability (not the writer's handle, nor its recompute fallback) leaves the read
        alone: a stranger naming the request id neither takes nor drops it."""
        prefetch = self._pending.get(location.request_id)
        if prefetch is None or not prefetch.proven_by(location):
            return None
        del self._pending[location.request_id]
        if prefetch.matches(location):
            return prefetch
        await prefetch.drop()
        return None

    async def cancel(self, request_id: str) -> None:
        """Stop the read of ``request_id`` and forget it, leaving the transport's copy for a
        ``Decode`` call to read the usual way."""
        prefetch = self._pending.pop(request_id, None)
        if prefetch is not None:
            await prefetch.stop()

    async def wait(self, request_id: str) -> str:
        """Wait until the read of ``request_id`` has ended; why it failed, "" if it did not
        (the ``Decode`` call then takes the payload, or recomputes)."""
        prefetch = self._pending.get(request_id)
        if prefetch is None:
            return "no prefetch of this request"
        try:
            await asyncio.shield(prefetch.task)  # a cancelled wait is ``cancel``'s business
        except PdServeError as err:
            return str(err)
        return ""

    async def sweep(self) -> int:
        """Drop the prefetches past their expiry; how many."""
        now = time.monotonic()
        stale = [rid for rid, p in self._pending.items() if p.expired(now)]
        for rid in stale:
            prefetch = self._pending.pop(rid)
            logger.warning("%s: prefetched KV never taken by a Decode call; dropped", rid)
            await prefetch.drop()
        return len(stale)

    async def close(self) -> None:
        pending, self._pending = self._pending, {}
        for prefetch in pending.values():
            await prefetch.drop()
