"""Reading a KV store entry while its writer is still putting it (``GetRequest.follow``).

A decode worker that learns of a hand-off when it begins (``Decode.Prefetch``) reads the
layers as the prefill worker writes them, instead of after the commit: the read overlaps the
prefill's compute, and decoding can start as soon as the last layer has landed.

``Follower.parts`` yields the write's pieces as they are appended (woken by the write's
listener, no polling); once the write commits it pins the entry (``open_read``) and yields
the rest from there, so the bytes that follow a commit are the stored entry's, of exactly
that version. A write that is aborted (its stream broke off, its lease ran out) ends the read
with ``KVTransferError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pdserve.errors import KVTransferError
from pdserve.kvstore.entry import Part
from pdserve.kvstore.handles import PendingPut
from pdserve.kvstore.store import KVStore

WRITER_WAIT_S = 5.0
"""How long a follow-read waits for a writer that has not begun yet: the prefill worker
opens its write before it announces the hand-off, but the two travel separately."""


async def find_write(store: KVStore, key: str, wait_s: float = WRITER_WAIT_S) -> PendingPut | None:
    """The write in progress under ``key``, or the next one to begin within ``wait_s``; None
    if a committed entry is there already, or if no writer came."""
    write = store.pending_write(key)
    if write is not None or store.stat(key) is not None:
        return write
    began: asyncio.Future[PendingPut] = asyncio.get_running_loop().create_future()

    def found(w: PendingPut) -> None:
        if not began.done():
            began.set_result(w)

    stop = store.watch_writes(key, found)
    try:
        return await asyncio.wait_for(began, wait_s)
    except TimeoutError:
        return None
    finally:
        stop()


class Follower:
    """One follow-read of ``write`` in ``store``; ``version`` is set once it has committed."""

    def __init__(self, store: KVStore, write: PendingPut) -> None:
        self.store = store
        self.write = write
        self.key = write.key
        self.header = write.header
        self.total_bytes = write.total_bytes
        self.version = 0

    async def parts(self) -> AsyncIterator[Part]:
        """Every piece of the entry, in order, as it becomes available."""
        changed = asyncio.Event()
        stop = self.write.listen(changed.set)
        sent = 0
        try:
            while self.write.open:
                changed.clear()
                for part in self.write.appended(sent):
                    sent += 1
                    yield part
                if self.write.open:
                    await changed.wait()
        finally:
            stop()
        if not self.write.version:
            raise KVTransferError(f"write of {self.key!r} broke off: {self.write.failure}")
        handle = self.store.open_read(self.key)  # pinned while the rest goes out
        try:
            if handle.payload.version != self.write.version:
                raise KVTransferError(f"entry {self.key!r} was replaced while it was read")
            self.version = self.write.version
            for part in handle.payload.parts[sent:]:
                yield part
        finally:
            handle.close()
