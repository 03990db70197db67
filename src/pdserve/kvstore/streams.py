"""The store's side of the chunk streams of the ``KVStore`` service: ``put_chunks`` writes a
Put stream as its chunks arrive, ``read_chunks`` yields the chunks of a Get.

``put_chunks``: the first chunk (it carries the key) reserves the room (all of it when
``total_bytes`` is given), so a payload that cannot fit is refused before its data arrives;
every chunk's CRC-32 is checked beside the loop (``CrcPipeline``) and the checks drained
before the commit. A stream that breaks off before its last chunk leaves nothing behind.
A ``PutSink`` may take the data instead of the store (a decode worker's endpoint assembles
hand-offs as they land) and hand it over whole at the end.

``read_chunks``: the entry pinned while it streams, in the chunks it was written in; or, with
``follow``, an entry still being written, chunk by chunk as its pieces arrive
(``kvstore.follow``). ``delete_after_read`` deletes it once its last chunk went out.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

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


class PutSink(Protocol):
    """Takes a Put's data instead of the store, and hands it over whole at the end."""

    def feed(self, data: Buffer, crc32: int) -> None:
        """The next chunk's data (its CRC-32 checked already)."""
        ...

    def finish(self) -> tuple[tuple[Part, ...], object | None]:
        """The data as the entry's parts, and an object to attach to the entry."""
        ...


SinkFor = Callable[[ChunkReader], PutSink | None]
"""Where a Put's data goes besides the store, given its first chunk; None: the store keeps
the chunks as they came."""


@dataclass(frozen=True, slots=True)
class PutOutcome:
    """What a committed Put stored (``PutResponse``)."""

    key: str
    num_bytes: int
    num_chunks: int
    lease_s: float


def _no_sink(reader: ChunkReader) -> PutSink | None:
    return None


async def put_chunks(
    store: KVStore, chunks: AsyncIterator[Chunk], sink_for: SinkFor = _no_sink
) -> PutOutcome:
    """Write one Put stream into ``store`` (see the module docstring)."""
    reader = ChunkReader(limit_bytes=store.capacity_bytes, verify=False)
    crcs = CrcPipeline()  # checks beside the loop; drained before the commit
    write: PendingPut | None = None
    sink: PutSink | None = None
    try:
        async for chunk in chunks:
            data = reader.feed(chunk)
            await crcs.check(chunk)
            if write is None:
                crcs.key = reader.key
                if not reader.key:
                    raise InvalidArgumentError("key", "the first chunk must carry the key")
                write = store.begin_put(
                    reader.key,
                    header=reader.header,
                    lease_s=reader.lease_s,
                    total_bytes=reader.total_bytes,
                    cache=reader.cache,
                )
                sink = sink_for(reader)
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
    return PutOutcome(reader.key, reader.num_bytes, reader.num_chunks, lease)


async def read_chunks(
    store: KVStore,
    key: str,
    *,
    follow: bool = False,
    delete_after_read: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> AsyncGenerator[Chunk, None]:
    """The chunks of one Get (see the module docstring)."""
    write = await find_write(store, key) if follow else None
    if write is not None:
        async for chunk in _follow(store, Follower(store, write), delete_after_read, chunk_bytes):
            yield chunk
        return
    handle = store.open_read(key)
    entry = handle.payload
    complete = False
    try:
        for chunk in split_parts(
            entry.parts, key=entry.key, header=entry.header, chunk_bytes=chunk_bytes
        ):
            yield chunk
        complete = True
    finally:
        handle.close()
    if complete and delete_after_read:
        # Only after the last chunk went out, so the status the reader sees follows it;
        # the version guards an entry replaced meanwhile.
        store.delete(entry.key, version=entry.version)


async def _follow(
    store: KVStore, follower: Follower, delete_after_read: bool, chunk_bytes: int
) -> AsyncIterator[Chunk]:
    """An entry still being written, chunk by chunk as its pieces arrive; the last chunk
    (empty) once it is committed. The first (empty) carries the stream's fields at once;
    the data chunks then have the seqs they were put with (see ``split_parts``)."""
    sequence = ChunkSequence(follower.key, follower.header, total_bytes=follower.total_bytes)
    yield sequence.chunk(b"", 0)
    async for part in follower.parts():
        for data, crc in chunk_pieces((part,), chunk_bytes):
            yield sequence.chunk(data, crc)
    yield sequence.end()
    if delete_after_read:
        store.delete(follower.key, version=follower.version)
