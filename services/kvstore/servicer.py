"""The KVStore gRPC service: translates pdserve.v1 KVStore messages to ``KVStore`` calls.

The streams are the store's (``pdserve.kvstore.streams``): ``Put`` writes as the chunks arrive
(a layer-wise hand-off lands while the prefill still computes) and a stream that breaks off
before its last chunk leaves nothing behind; ``Get`` keeps the entry pinned while it streams
it, in the chunks it was written in. A subclass may take a Put's data itself (``sink``): a
decode worker's endpoint assembles hand-offs as they arrive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, TypeAlias

from grpc.aio import ServicerContext

from pdserve.kvstore.chunks import DEFAULT_CHUNK_BYTES, ChunkReader
from pdserve.kvstore.convert import entry_stat_to_proto, put_response, store_stats_to_proto
from pdserve.kvstore.store import KVStore
from pdserve.kvstore.streams import PutSink, put_chunks, read_chunks
from pdserve.kvstore.wire import Chunk
from pdserve.v1 import kvstore_pb2

Context: TypeAlias = ServicerContext[Any, Any]

__all__ = ["Context", "KVStoreServicer", "PutSink"]


class KVStoreServicer:
    """pdserve.v1.KVStore on top of one ``KVStore``; register it with
    ``pdserve.kvstore.wire.add_kvstore_servicer`` (its chunks skip protobuf's copies)."""

    def __init__(self, store: KVStore, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes

    def sink(self, reader: ChunkReader) -> PutSink | None:
        """Where a Put's data goes besides the store, given its first chunk; None: the store
        keeps the chunks as they came. (A decode worker's endpoint assembles hand-offs.)"""
        return None

    async def Put(  # noqa: N802 - gRPC method names
        self, request_iterator: AsyncIterator[Chunk], context: Context
    ) -> kvstore_pb2.PutResponse:
        return put_response(await put_chunks(self.store, request_iterator, self.sink))

    async def Get(  # noqa: N802 - gRPC method names
        self, request: kvstore_pb2.GetRequest, context: Context
    ) -> AsyncIterator[Chunk]:
        chunks = read_chunks(
            self.store,
            request.key,
            follow=request.follow,
            delete_after_read=request.delete_after_read,
            chunk_bytes=self.chunk_bytes,
        )
        async with aclosing(chunks):  # a cancelled call unpins the entry at once
            async for chunk in chunks:
                yield chunk

    async def Lookup(  # noqa: N802 - gRPC method names
        self, request: kvstore_pb2.LookupRequest, context: Context
    ) -> kvstore_pb2.LookupResponse:
        return kvstore_pb2.LookupResponse(num_leading=self.store.lookup(list(request.keys)))

    async def Delete(  # noqa: N802 - gRPC method names
        self, request: kvstore_pb2.DeleteRequest, context: Context
    ) -> kvstore_pb2.DeleteResponse:
        return kvstore_pb2.DeleteResponse(deleted=self.store.delete(request.key))

    async def Stat(  # noqa: N802 - gRPC method names
        self, request: kvstore_pb2.StatRequest, context: Context
    ) -> kvstore_pb2.StatResponse:
        if not request.key:
            return store_stats_to_proto(self.store.stats())
        return entry_stat_to_proto(self.store.stat(request.key))
