"""The KVStore gRPC service: translates pdserve.v1 KVStore messages to ``KVStore`` calls.

``Put`` writes as the chunks arrive (a layer-wise hand-off lands while the prefill still
computes); a stream that breaks off before its last chunk leaves nothing behind. ``Get`` keeps
the entry pinned while it streams it, in the chunks it was written in. A subclass may take a
Put's data itself (``sink``): a decode worker's endpoint assembles hand-offs as they arrive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, TypeAlias

from grpc.aio import ServicerContext

from pdserve.errors import InvalidArgumentError
from pdserve.kvstore.chunks import (
    DEFAULT_CHUNK_BYTES,
    ChunkReader,
    ChunkSequence,
    CrcPipeline,
    chunk_pieces,
    split_parts,
)
from pdserve.kvstore.follow import Follower, find_write
from pdserve.kvstore.store import KVStore, Part, PendingPut
from pdserve.kvstore.wire import Buffer, Chunk
from pdserve.v1 import kvstore_pb2

Context: TypeAlias = ServicerContext[Any, Any]


class PutSink(Protocol):
    """Takes a Put's data instead of the store, and hands it over whole at the end."""

    def feed(self, data: Buffer, crc32: int) -> None:
        """The next chunk's data (its CRC-32 checked already)."""
        ...

    def finish(self) -> tuple[tuple[Part, ...], object | None]:
        """The data as the entry's parts, and an object to attach to the entry."""
        ...


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
        reader = ChunkReader(limit_bytes=self.store.capacity_bytes, verify=False)
        crcs = CrcPipeline()  # checks beside the loop; drained before the commit
        write: PendingPut | None = None
        sink: PutSink | None = None
        try:
            async for chunk in request_iterator:
                data = reader.feed(chunk)
                await crcs.check(chunk)
                if write is None:
                    crcs.key = reader.key
                    # The first chunk reserves the room (all of it when total_bytes is given),
                    # so a payload that cannot fit is refused before its data arrives.
                    if not reader.key:
                        raise InvalidArgumentError("key", "the first chunk must carry the key")
                    write = self.store.begin_put(
                        reader.key,
                        header=reader.header,
                        lease_s=reader.lease_s,
                        total_bytes=reader.total_bytes,
                        cache=reader.cache,
                    )
                    sink = self.sink(reader)
                if not data:
                    continue
                if sink is None:
                    write.append(data, chunk.crc32)  # checked by the reader: kept for Gets
                else:
                    write.account(len(data))
                    sink.feed(data, chunk.crc32)
            if write is None:
                raise InvalidArgumentError("key", "the Put stream carried no chunk")
            reader.check_complete()
            await crcs.drain()
            if sink is None:
                lease = write.commit()
            else:
                parts, attachment = sink.finish()
                lease = write.commit(parts=parts, attachment=attachment)
        finally:
            crcs.cancel()
            if write is not None:
                write.abort("the Put stream broke off")  # no-op after the commit
        return kvstore_pb2.PutResponse(
            key=reader.key,
            num_bytes=reader.num_bytes,
            num_chunks=reader.num_chunks,
            lease_s=lease,
        )

    async def Get(  # noqa: N802 - gRPC method names
        self, request: kvstore_pb2.GetRequest, context: Context
    ) -> AsyncIterator[Chunk]:
        write = await find_write(self.store, request.key) if request.follow else None
        if write is not None:
            async for chunk in self._follow(Follower(self.store, write), request):
                yield chunk
            return
        handle = self.store.open_read(request.key)
        entry = handle.payload
        complete = False
        try:
            for chunk in split_parts(
                entry.parts, key=entry.key, header=entry.header, chunk_bytes=self.chunk_bytes
            ):
                yield chunk
            complete = True
        finally:
            handle.close()
        if complete and request.delete_after_read:
            # Only after the last chunk went out, so the status the reader sees follows it;
            # the version guards an entry replaced meanwhile.
            self.store.delete(entry.key, version=entry.version)

    async def _follow(
        self, follower: Follower, request: kvstore_pb2.GetRequest
    ) -> AsyncIterator[Chunk]:
        """An entry still being written, chunk by chunk as its pieces arrive; the last chunk
        (empty) once it is committed. The first (empty) carries the stream's fields at once;
        the data chunks then have the seqs they were put with (see ``split_parts``)."""
        sequence = ChunkSequence(follower.key, follower.header, total_bytes=follower.total_bytes)
        yield sequence.chunk(b"", 0)
        async for part in follower.parts():
            for data, crc in chunk_pieces((part,), self.chunk_bytes):
                yield sequence.chunk(data, crc)
        yield sequence.end()
        if request.delete_after_read:
            self.store.delete(follower.key, version=follower.version)

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
            s = self.store.stats()
            return kvstore_pb2.StatResponse(
                exists=True,
                used_bytes=s.used_bytes,
                capacity_bytes=s.capacity_bytes,
                num_entries=s.num_entries,
                disk_used_bytes=s.disk_used_bytes,
                disk_capacity_bytes=s.disk_capacity_bytes,
                num_disk_entries=s.num_disk_entries,
                num_pinned=s.num_pinned,
                num_writing=s.num_writing,
                reserved_bytes=s.reserved_bytes,
                bytes_in=s.bytes_in,
                bytes_out=s.bytes_out,
                hits=s.hits,
                misses=s.misses,
                expired=s.expired,
                spills=s.spills,
                reloads=s.reloads,
                evictions=s.evictions,
                lookups=s.lookups,
                lookup_hits=s.lookup_hits,
                uptime_s=s.uptime_s,
                num_cache_entries=s.num_cache_entries,
            )
        entry = self.store.stat(request.key)
        if entry is None:
            return kvstore_pb2.StatResponse(exists=False)
        return kvstore_pb2.StatResponse(
            exists=True,
            num_bytes=entry.num_bytes,
            lease_remaining_s=entry.lease_remaining_s,
            tier=entry.tier.value,
            refs=entry.refs,
        )
