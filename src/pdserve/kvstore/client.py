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

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from dataclasses import dataclass

import grpc
from grpc.aio import AioRpcError

from pdserve.errors import (
    CapacityError,
    InvalidArgumentError,
    KVTransferError,
    PdServeError,
    UnknownRequestError,
)
from pdserve.kvstore.chunks import (
    DEFAULT_CHUNK_BYTES,
    ChunkAssembler,
    ChunkReader,
    ChunkSequence,
    CrcPipeline,
    split,
)
from pdserve.kvstore.convert import store_stat_from_proto
from pdserve.kvstore.stats import StoreStat
from pdserve.kvstore.wire import Chunk, KVStoreCalls
from pdserve.security.options import INSECURE, SecurityOptions
from pdserve.telemetry import tracing
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

Bytes = bytes | bytearray | memoryview
Piece = tuple[Bytes, int] | tuple[Bytes, int, bytes]
"""A chunk's data with its CRC-32 already computed by the caller (sent as one chunk); a third
item is a lead sent in front of the data, in the same chunk, and covered by the CRC
(``Chunk.lead``)."""

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # Reconnect to a store restarted on its address within a second, not gRPC's default of
    # up to two minutes: hand-offs recompute until then.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


@dataclass(frozen=True, slots=True)
class PutResult:
    """What the store confirmed for a put."""

    num_bytes: int
    num_chunks: int
    lease_s: float


def translate_error(err: AioRpcError, what: str) -> PdServeError:
    code, details = err.code(), err.details() or ""
    if code is grpc.StatusCode.NOT_FOUND:
        return UnknownRequestError(f"{what}: {details}")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityError(f"{what}: {details}")
    return KVTransferError(f"{what} failed with {code.name}: {details}")


async def send_pieces(
    call: grpc.aio.StreamUnaryMultiCallable,
    key: str,
    pieces: AsyncIterable[Bytes | Piece],
    *,
    header: bytes = b"",
    total_bytes: int = 0,
    lease_s: float = 0.0,
    cache: bool = False,
    timeout_s: float | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    what: str,
) -> PutResult:
    """Stream ``pieces`` as ``KVChunk``s into ``call`` (``KVStore.Put``, ``Decode.Push``: any
    client-streaming method of ``Chunk`` answered by a ``PutResponse``), each sent at once, in
    chunks of ``chunk_bytes`` (a ``Piece`` with its CRC-32 as one chunk, however long). The
    first chunk carries ``key``, ``header``, ``total_bytes``, ``lease_s`` and ``cache``.

    If ``pieces`` raises, the stream is cut off (the receiver keeps nothing) and the error
    propagates as ``KVTransferError``; a failed call as ``translate_error`` maps it (``what`` names
    it). No deadline unless ``timeout_s`` is given.
    """
    failure: list[Exception] = []

    async def chunks() -> AsyncGenerator[Chunk, None]:
        try:
            async for chunk in _chunks():
                yield chunk
        except Exception as err:  # gRPC turns it into a cancelled call: keep the cause
            failure.append(err)
            raise

    async def _chunks() -> AsyncGenerator[Chunk, None]:
        sequence = ChunkSequence(key, header, lease_s, total_bytes, cache)
        async for piece in pieces:
            if isinstance(piece, tuple):
                yield sequence.chunk(*piece)
                continue
            view = memoryview(piece).cast("B")
            for start in range(0, len(view), chunk_bytes):
                yield sequence.chunk(view[start : start + chunk_bytes])
        yield sequence.end()

    try:
        resp: kvstore_pb2.PutResponse = await call(chunks(), timeout=timeout_s)
    except AioRpcError as err:
        raise translate_error(err, what) from err
    except asyncio.CancelledError:
        if failure:  # the data source failed, not the caller who cancelled
            raise KVTransferError(f"{what}: its data failed: {failure[0]}") from failure[0]
        raise
    return PutResult(resp.num_bytes, resp.num_chunks, resp.lease_s)


class KVStoreClient:
    """Put, get, delete and stat KV payloads on one KVStore service at ``address``."""

    follows = True
    """A ``stream(follow=True)`` reads an entry while its writer puts it (``kvstore.follow``)."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 10.0,
        security: SecurityOptions = INSECURE,
    ) -> None:
        """The calls carry the process-wide tracing's interceptors (CLIENT spans,
        ``traceparent``). ``security``: TLS and the internal token of the calls
        (``pdserve.security``)."""
        if not address:
            raise InvalidArgumentError("address", "must be host:port")
        if not timeout_s > 0:
            raise InvalidArgumentError("timeout_s", f"must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.chunk_bytes = DEFAULT_CHUNK_BYTES
        self.security = security
        self._channel = security.aio_channel(
            address, options=CHANNEL_OPTIONS, interceptors=tracing.client_interceptors()
        )
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._chunks = KVStoreCalls(self._channel)  # Put and Get without protobuf's copies

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
    ) -> PutResult:
        """Store ``header`` + ``payload`` under ``key`` for ``lease_s`` seconds (0: default)."""
        chunks = split(
            payload,
            key=key,
            header=header,
            lease_s=lease_s,
            chunk_bytes=chunk_bytes or self.chunk_bytes,
            cache=cache,
        )
        try:
            resp: kvstore_pb2.PutResponse = await self._chunks.Put(
                chunks, timeout=timeout_s or self.timeout_s
            )
        except AioRpcError as err:
            raise translate_error(err, f"put {key!r} to {self.address}") from err
        return PutResult(resp.num_bytes, resp.num_chunks, resp.lease_s)

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
    ) -> PutResult:
        """Store the pieces as they come (each sent at once, in chunks of ``chunk_bytes``; a
        ``Piece`` with its CRC-32 as one chunk, however long).

        ``total_bytes`` (header + data, 0 = unknown) lets the store reserve the room, or refuse
        the payload, before the data arrives. If ``pieces`` raises, the stream is cut off and
        the store keeps nothing; the error propagates. Unlike the other calls, the stream has
        no deadline unless ``timeout_s`` is given: it lasts as long as its producer (a prefill
        of any length), so bound the wait from the caller and cancel to cut it off.
        """
        return await send_pieces(
            self._chunks.Put,
            key,
            pieces,
            header=header,
            total_bytes=total_bytes,
            lease_s=lease_s,
            cache=cache,
            timeout_s=timeout_s,
            chunk_bytes=self.chunk_bytes,
            what=f"put {key!r} to {self.address}",
        )

    async def stream(
        self,
        key: str,
        *,
        delete_after_read: bool = False,
        timeout_s: float | None = None,
        follow: bool = False,
    ) -> AsyncGenerator[Chunk, None]:
        """The chunks of ``key`` as they arrive; the first one carries the header. With
        ``follow``, an entry still being written streams as its writer puts it.

        Seq is checked at once, CRC-32s beside the loop (``CrcPipeline``): a chunk may come
        out before its check is done, and the stream raises before it ends if one fails, or if
        it stopped short of its last chunk. Act on the data only once the stream has ended.
        """
        reader = ChunkReader(verify=False)
        crcs = CrcPipeline(key)
        call = self._chunks.Get(
            kvstore_pb2.GetRequest(key=key, delete_after_read=delete_after_read, follow=follow),
            timeout=timeout_s or self.timeout_s,
        )
        try:
            async for chunk in call:
                try:
                    reader.feed(chunk)
                except InvalidArgumentError as err:  # gaps or repeats: a broken stream
                    raise KVTransferError(
                        f"get {key!r} from {self.address}: bad chunk stream: {err}"
                    ) from err
                await crcs.check(chunk)
                yield chunk
            reader.check_complete()
            await crcs.drain()
        except AioRpcError as err:
            raise translate_error(err, f"get {key!r} from {self.address}") from err
        finally:
            crcs.cancel()
            call.cancel()  # a no-op once the stream ended; stops it on any early exit

    async def lookup(self, keys: Sequence[str], *, timeout_s: float | None = None) -> int:
        """How many of ``keys``, from the first on, the store holds."""
        try:
            resp: kvstore_pb2.LookupResponse = await self._stub.Lookup(
                kvstore_pb2.LookupRequest(keys=list(keys)), timeout=timeout_s or self.timeout_s
            )
        except AioRpcError as err:
            raise translate_error(err, f"lookup on {self.address}") from err
        return int(resp.num_leading)

    async def get(
        self, key: str, *, delete_after_read: bool = False, timeout_s: float | None = None
    ) -> bytes:
        """The payload under ``key`` (header followed by data), every chunk CRC-checked.

        With ``delete_after_read`` the store deletes the entry once it has streamed all of it;
        when this returns, the deletion has happened (it precedes the end of the stream).
        """
        assembler = ChunkAssembler()
        call = self._chunks.Get(
            kvstore_pb2.GetRequest(key=key, delete_after_read=delete_after_read),
            timeout=timeout_s or self.timeout_s,
        )
        try:
            async for chunk in call:
                assembler.feed(chunk)
        except AioRpcError as err:
            raise translate_error(err, f"get {key!r} from {self.address}") from err
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
            raise translate_error(err, f"delete {key!r} on {self.address}") from err
        return resp.deleted

    async def stat(self, key: str = "", *, timeout_s: float | None = None) -> StoreStat:
        """One key's size and lease, or with ``key=""`` the store's totals."""
        try:
            r: kvstore_pb2.StatResponse = await self._stub.Stat(
                kvstore_pb2.StatRequest(key=key), timeout=timeout_s or self.timeout_s
            )
        except AioRpcError as err:
            raise translate_error(err, f"stat {key!r} on {self.address}") from err
        return store_stat_from_proto(r, totals=not key)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> KVStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
