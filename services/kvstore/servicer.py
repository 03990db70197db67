"""The KVStore gRPC service: translates pdserve.v1 KVStore messages to ``KVStore`` calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeAlias

from grpc.aio import ServicerContext

from pdserve.errors import InvalidArgumentError
from pdserve.kvstore.chunks import DEFAULT_CHUNK_BYTES, ChunkAssembler, split
from pdserve.kvstore.store import KVStore
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

Context: TypeAlias = ServicerContext[Any, Any]


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """pdserve.v1.KVStore on top of one in-memory ``KVStore``."""

    def __init__(self, store: KVStore, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes

    async def Put(  # noqa: N802 - gRPC method names
        self, request_iterator: AsyncIterator[kvstore_pb2.KVChunk], context: Context
    ) -> kvstore_pb2.PutResponse:
        assembler = ChunkAssembler(limit_bytes=self.store.capacity_bytes)
        async for chunk in request_iterator:
            first = assembler.num_chunks == 0
            assembler.feed(chunk)
            if first:
                # Refuse before the data arrives when the first chunk says it cannot fit.
                if not assembler.key:
                    raise InvalidArgumentError("key", "the first chunk must carry the key")
                self.store.lease_for(assembler.lease_s)
                if assembler.total_bytes:
                    self.store.check_room(assembler.total_bytes, replacing=assembler.key)
        if assembler.num_chunks == 0:
            raise InvalidArgumentError("key", "the Put stream carried no chunk")
        data = assembler.finish()
        lease = self.store.put(assembler.key, data, assembler.lease_s, header=assembler.header)
        return kvstore_pb2.PutResponse(
            key=assembler.key,
            num_bytes=assembler.num_bytes,
            num_chunks=assembler.num_chunks,
            lease_s=lease,
        )

    async def Get(  # noqa: N802 - gRPC method names
        self, request: kvstore_pb2.GetRequest, context: Context
    ) -> AsyncIterator[kvstore_pb2.KVChunk]:
        entry = self.store.get(request.key)
        for chunk in split(
            entry.data, key=entry.key, header=entry.header, chunk_bytes=self.chunk_bytes
        ):
            yield chunk
        if request.delete_after_read:
            # Only after the last chunk went out, so the status the reader sees follows it;
            # the version guards an entry replaced meanwhile.
            self.store.delete(entry.key, version=entry.version)

    async def Delete(  # noqa: N802 - gRPC method names
        self, request: kvstore_pb2.DeleteRequest, context: Context
    ) -> kvstore_pb2.DeleteResponse:
        return kvstore_pb2.DeleteResponse(deleted=self.store.delete(request.key))

    async def Stat(  # noqa: N802 - gRPC method names
        self, request: kvstore_pb2.StatRequest, context: Context
    ) -> kvstore_pb2.StatResponse:
        if not request.key:
            s = self.store.stats()
            return kvstore_pb2.StatResponse(
                exists=True,
                used_bytes=s.used_bytes,
                capacity_bytes=s.capacity_bytes,
                num_entries=s.num_entries,
            )
        entry = self.store.stat(request.key)
        if entry is None:
            return kvstore_pb2.StatResponse(exists=False)
        return kvstore_pb2.StatResponse(
            exists=True, num_bytes=entry.num_bytes, lease_remaining_s=entry.lease_remaining_s
        )
