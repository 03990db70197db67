"""The KV store seam: ``StoreClient``, what the connectors, the prefix reuse and the workers
call, and ``open_store``, the one place that picks the store an address names.

Two stores stand behind it:

* ``host:port``: pdserve's KV store service (``KVStoreClient``, gRPC; ``services/kvstore``);
* ``mooncake://MASTER[?...]``: a Mooncake Store (``mooncake.MooncakeStoreClient``; the
  optional ``pdserve[mooncake]``, refused at start without it).

Hand-off handles carry the address, so a decode worker reads from whichever store the
prefill worker wrote to, with no setting of its own.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from typing import Protocol

from pdserve.kvstore.client import Bytes, KVStoreClient, Piece, PutResult
from pdserve.kvstore.mooncake.address import MooncakeAddress, is_mooncake
from pdserve.kvstore.wire import Chunk
from pdserve.security.options import INSECURE, SecurityOptions


class StoreClient(Protocol):
    """A KV store's client (``KVStoreClient``, ``MooncakeStoreClient``). Failures are pdserve
    errors: ``UnknownRequestError`` (absent), ``CapacityError`` (full), ``KVTransferError``
    (anything else)."""

    @property
    def address(self) -> str: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def security(self) -> SecurityOptions:
        """TLS and the internal token of this process's calls (the callers reuse them)."""
        ...

    @property
    def follows(self) -> bool:
        """Whether ``stream(follow=True)`` reads an entry while it is written (a prefetch)."""
        ...

    async def put(
        self,
        key: str,
        payload: Bytes,
        lease_s: float = 0.0,
        *,
        header: bytes = b"",
        chunk_bytes: int | None = None,
        timeout_s: float | None = None,
        cache: bool = False,
    ) -> PutResult: ...

    async def put_stream(
        self,
        key: str,
        pieces: AsyncIterable[Bytes | Piece],
        *,
        header: bytes = b"",
        total_bytes: int = 0,
        lease_s: float = 0.0,
        cache: bool = False,
        timeout_s: float | None = None,
    ) -> PutResult: ...

    def stream(
        self,
        key: str,
        *,
        delete_after_read: bool = False,
        timeout_s: float | None = None,
        follow: bool = False,
    ) -> AsyncGenerator[Chunk, None]: ...

    async def get(
        self, key: str, *, delete_after_read: bool = False, timeout_s: float | None = None
    ) -> bytes: ...

    async def lookup(self, keys: Sequence[str], *, timeout_s: float | None = None) -> int: ...

    async def delete(self, key: str, *, timeout_s: float | None = None) -> bool: ...

    async def close(self) -> None: ...


def check_address(address: str, field: str = "kvstore") -> None:
    """Refuse a malformed store address, or a ``mooncake://`` one without the package, naming
    ``field`` (at start, before anything is served)."""
    if is_mooncake(address):
        from pdserve.kvstore.mooncake.library import load  # the optional package

        MooncakeAddress.parse(address, field)
        load(field)


def open_store(
    address: str,
    *,
    timeout_s: float = 10.0,
    security: SecurityOptions = INSECURE,
    local_host: str = "",
    field: str = "kvstore",
) -> StoreClient:
    """The client of the store ``address`` names (see the module doc). ``local_host``: the
    address other hosts reach this process at (a Mooncake client's segment); ``field``: what a
    refusal of the address names (a malformed one, or a Mooncake Store without the package)."""
    if is_mooncake(address):
        from pdserve.kvstore.mooncake.client import MooncakeStoreClient

        return MooncakeStoreClient(
            address, timeout_s=timeout_s, local_host=local_host, security=security, field=field
        )
    return KVStoreClient(address, timeout_s=timeout_s, security=security)
