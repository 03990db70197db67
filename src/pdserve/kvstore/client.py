"""KVStoreClient: the async client of one ``pdserve.v1.KVStore`` service.

Every call has a deadline (``timeout_s``, per client, overridable per call). Failures come back
as pdserve errors, so that a servicer using the client maps them like any other:

* DEADLINE_EXCEEDED, UNAVAILABLE and every other transport or server failure ->
  ``KVTransferError`` (UNAVAILABLE);
* NOT_FOUND -> ``UnknownRequestError`` (the payload is absent or its lease ran out);
* RESOURCE_EXHAUSTED -> ``CapacityError`` (the store is full).

Create the client inside the event loop that uses it; ``close()`` (or ``async with``) releases
the channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

import grpc
from grpc.aio import AioRpcError

from pdserve.errors import (
    CapacityError,
    InvalidArgumentError,
    KVTransferError,
    PdServeError,
    UnknownRequestError,
)
from pdserve.kvstore.chunks import DEFAULT_CHUNK_BYTES, ChunkAssembler, split
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


@dataclass(frozen=True, slots=True)
class PutResult:
    """What the store confirmed for a put."""

    num_bytes: int
    num_chunks: int
    lease_s: float


@dataclass(frozen=True, slots=True)
class StoreStat:
    """``Stat`` of one key (``exists``, ``num_bytes``, ``lease_remaining_s``) or the totals."""

    exists: bool
    num_bytes: int
    lease_remaining_s: float
    used_bytes: int
    capacity_bytes: int
    num_entries: int


def _translate(err: AioRpcError, what: str) -> PdServeError:
    code, details = err.code(), err.details() or ""
    if code is grpc.StatusCode.NOT_FOUND:
        return UnknownRequestError(f"{what}: {details}")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityError(f"{what}: {details}")
    return KVTransferError(f"{what} failed with {code.name}: {details}")


class KVStoreClient:
    """Put, get, delete and stat KV payloads on one KVStore service at ``address``."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 10.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if not address:
            raise InvalidArgumentError("address", "must be host:port")
        if not timeout_s > 0:
            raise InvalidArgumentError("timeout_s", f"must be > 0, got {timeout_s}")
        if chunk_bytes < 1:
            raise InvalidArgumentError("chunk_bytes", f"must be >= 1, got {chunk_bytes}")
        self.address = address
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._channel = grpc.aio.insecure_channel(address, options=list(CHANNEL_OPTIONS))
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)

    async def put(
        self,
        key: str,
        payload: bytes,
        lease_s: float = 0.0,
        *,
        header: bytes = b"",
        chunk_bytes: int | None = None,
        timeout_s: float | None = None,
    ) -> PutResult:
        """Store ``header`` + ``payload`` under ``key`` for ``lease_s`` seconds (0: default)."""
        chunks = split(
            payload,
            key=key,
            header=header,
            lease_s=lease_s,
            chunk_bytes=chunk_bytes or self.chunk_bytes,
        )
        try:
            resp: kvstore_pb2.PutResponse = await self._stub.Put(
                chunks, timeout=timeout_s or self.timeout_s
            )
        except AioRpcError as err:
            raise _translate(err, f"put {key!r} to {self.address}") from err
        return PutResult(resp.num_bytes, resp.num_chunks, resp.lease_s)

    async def get(
        self, key: str, *, delete_after_read: bool = False, timeout_s: float | None = None
    ) -> bytes:
        """The payload under ``key`` (header followed by data), every chunk CRC-checked.

        With ``delete_after_read`` the store deletes the entry once it has streamed all of it;
        when this returns, the deletion has happened (it precedes the end of the stream).
        """
        assembler = ChunkAssembler()
        call = self._stub.Get(
            kvstore_pb2.GetRequest(key=key, delete_after_read=delete_after_read),
            timeout=timeout_s or self.timeout_s,
        )
        try:
            async for chunk in call:
                assembler.feed(chunk)
        except AioRpcError as err:
            raise _translate(err, f"get {key!r} from {self.address}") from err
        except InvalidArgumentError as err:  # gaps or repeats: the stream is broken, not the call
            raise KVTransferError(
                f"get {key!r} from {self.address}: bad chunk stream: {err}"
            ) from err
        finally:
            call.cancel()  # a no-op once the stream ended; stops it on any early exit
        data = assembler.finish()
        return assembler.header + data

    async def delete(self, key: str, *, timeout_s: float | None = None) -> bool:
        """Delete ``key``; False if it was absent."""
        try:
            resp: kvstore_pb2.DeleteResponse = await self._stub.Delete(
                kvstore_pb2.DeleteRequest(key=key), timeout=timeout_s or self.timeout_s
            )
        except AioRpcError as err:
            raise _translate(err, f"delete {key!r} on {self.address}") from err
        return resp.deleted

    async def stat(self, key: str = "", *, timeout_s: float | None = None) -> StoreStat:
        """One key's size and lease, or with ``key=""`` the store's totals."""
        try:
            r: kvstore_pb2.StatResponse = await self._stub.Stat(
                kvstore_pb2.StatRequest(key=key), timeout=timeout_s or self.timeout_s
            )
        except AioRpcError as err:
            raise _translate(err, f"stat {key!r} on {self.address}") from err
        return StoreStat(
            r.exists,
            r.num_bytes,
            r.lease_remaining_s,
            r.used_bytes,
            r.capacity_bytes,
            r.num_entries,
        )

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
