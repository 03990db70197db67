"""Handles on one entry of the KV store: an open read (``ReadHandle``) and a write in progress
(``PendingPut``). Both call back into their store (``Ledger``: the ``KVStore`` that made them),
whose bookkeeping they change."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from pdserve.errors import InvalidArgumentError, KVTransferError

if TYPE_CHECKING:
    from pdserve.kvstore.entry import Part, StoredPayload, _Entry


class Ledger(Protocol):
    """The bookkeeping of a store that its handles change: ``KVStore``'s, named here so that
    the handles need not import the store that imports them."""

    _clock: Callable[[], float]

    def _unpin(self, entry: _Entry) -> None: ...

    def _reserve(self, write: PendingPut, num_bytes: int) -> None: ...

    def _commit(
        self, write: PendingPut, parts: tuple[Part, ...], attachment: object | None
    ) -> float: ...

    def _end_write(self, write: PendingPut) -> None: ...


class ReadHandle:
    """An open read of one entry: the entry stays in RAM until ``close()``."""

    def __init__(self, store: Ledger, entry: _Entry, payload: StoredPayload) -> None:
        self._store = store
        self._entry: _Entry | None = entry
        self.payload = payload

    def close(self) -> None:
        """Unpin (idempotent)."""
        if self._entry is not None:
            self._store._unpin(self._entry)
            self._entry = None


class PendingPut:
    """A write in progress: data arrives in pieces; readers see nothing before ``commit``
    (except followers: ``listen`` and ``appended``, see ``kvstore.follow``).

    The room is reserved up front when the size is known (``total_bytes``), else piece by
    piece. ``abort`` gives it back, as does ``KVStore.sweep`` once no piece arrived for a whole
    lease.
    """

    def __init__(
        self,
        store: Ledger,
        key: str,
        header: bytes,
        lease_s: float,
        total_bytes: int,
        cache: bool,
        deadline: float,
    ) -> None:
        self._store = store
        self.key = key
        self.header = header
        self.lease_s = lease_s
        self.total_bytes = total_bytes
        self.cache = cache
        self.deadline = deadline
        self.num_bytes = len(header)
        self.reserved = 0
        self._parts: list[Part] = []
        self._closed = False
        self._failure = ""
        self._listeners: list[Callable[[], None]] = []
        self.version = 0
        """The committed entry's version (0 before the commit)."""

    @property
    def open(self) -> bool:
        return not self._closed

    @property
    def failure(self) -> str:
        """Why the write was aborted; empty while open or once committed."""
        return self._failure

    def appended(self, start: int) -> list[Part]:
        """The pieces appended so far, from the ``start``-th on (empty once closed)."""
        return self._parts[start:]

    def listen(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` after every append, the commit and an abort; returns the
        function that stops it."""
        self._listeners.append(callback)

        def stop() -> None:
            if callback in self._listeners:
                self._listeners.remove(callback)

        return stop

    def _notify(self) -> None:
        for callback in list(self._listeners):
            callback()

    def append(self, data: bytes | bytearray | memoryview, crc32: int | None = None) -> None:
        """Add the next piece (``crc32``: its checked CRC-32, kept for readers); raises
        ``CapacityError`` if the store cannot hold it."""
        self._append_size(len(data))
        self._parts.append((data, crc32))
        self._notify()

    def _append_size(self, nbytes: int) -> None:
        self._check_open()
        size = self.num_bytes + nbytes
        if self.total_bytes and size > self.total_bytes:
            raise InvalidArgumentError(
                "total_bytes", f"write of {self.key!r} exceeds its announced {self.total_bytes}"
            )
        if size > self.reserved:
            self._store._reserve(self, size - self.reserved)
        self.num_bytes = size
        # A write that makes progress lives on (a long prefill streams for as long as it
        # computes); one that stalls for a whole lease is aborted by the sweep.
        self.deadline = self._store._clock() + self.lease_s

    def account(self, nbytes: int) -> None:
        """Count (and reserve) ``nbytes`` of data that the writer keeps itself, to hand over
        at ``commit(parts=...)``."""
        self._append_size(nbytes)

    def commit(
        self, *, parts: tuple[Part, ...] | None = None, attachment: object | None = None
    ) -> float:
        """Make the entry visible (replacing any under the key); returns its lease.

        ``parts``: the data, when the writer kept it (``account``) instead of appending it; it
        must be as long as what was counted. ``attachment``: an object over those bytes that
        readers of this process get with the entry (``StoredPayload.attachment``).
        """
        self._check_open()
        if parts is not None and sum(len(p) for p, _ in parts) != self.num_bytes - len(self.header):
            self.abort("its parts differ from what was counted")
            raise KVTransferError(f"write of {self.key!r} failed: its parts differ in length")
        if self.total_bytes and self.num_bytes != self.total_bytes:
            reason = f"it carried {self.num_bytes} bytes, announced {self.total_bytes}"
            self.abort(reason)
            raise KVTransferError(f"write of {self.key!r} failed: {reason}")
        parts = tuple(self._parts) if parts is None else parts
        self._parts = []
        self._closed = True
        lease = self._store._commit(self, parts, attachment)
        self._notify()
        return lease

    def abort(self, reason: str = "aborted") -> None:
        """Give the reservation back (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._failure = reason
        self._parts = []
        self._store._end_write(self)
        self._notify()

    def _check_open(self) -> None:
        if self._closed:
            why = self._failure or "already committed"
            raise KVTransferError(f"write of {self.key!r} is closed: {why}")
