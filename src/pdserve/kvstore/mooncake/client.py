"""``MooncakeStoreClient``: the KV store seam (``kvstore.backend.StoreClient``) over a Mooncake
Store.

The same calls as ``KVStoreClient`` (put, a streamed put, a streamed or whole get, lookup,
delete), so the connectors, the prefix reuse and the workers use either without knowing which:

* A streamed put (a hand-off's layer stream) keeps the pieces as the engine computes them
  and puts them as one object (``objects``; the library gathers the pieces, so nothing joins
  them into one buffer first) once its last piece is in: a Mooncake object is written whole,
  so readers see it complete or not at all, and a stream that breaks off leaves nothing. The
  writer's piece boundaries go into the object (a table at its end) so that a reader hands the
  frames on as they were cut: K and V land as tensors over the read buffer, without a copy.
* A get reads the object into one buffer (``get_into``) and yields the writer's pieces, each
  with its CRC-32 computed from the bytes read, which the frame collector combines and checks
  against each frame's own CRC: the check is end to end, from the writer's seal to the reader.
* No follow-reads (``follows`` is False): an object exists only once complete, so the decode
  side declines prefetches and reads at the ``Decode`` call.
* No leases: an object stays until it is deleted (a hand-off by its reader, ``delete_after_read``,
  or by the prefill worker's discard) or evicted by Mooncake when its segments fill
  (``mooncake_master --eviction_high_watermark_ratio``); ``lease_s`` is accepted and ignored.

Every blocking library call runs on the client's threads, bounded by ``timeout_s``; failures
come back as ``KVStoreClient``'s do: ``UnknownRequestError`` (absent), ``CapacityError`` (no
room), ``KVTransferError`` (anything else: master down, transfer failed). The client joins the
store lazily, at its first call, lending ``segment`` bytes of this process's memory to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pdserve.errors import (
    CapacityError,
    InvalidArgumentError,
    KVTransferError,
    PdServeError,
    UnknownRequestError,
)
from pdserve.kvstore.client import Bytes, Piece, PutResult
from pdserve.kvstore.crc import fast_crc32
from pdserve.kvstore.mooncake.address import MooncakeAddress
from pdserve.kvstore.mooncake.library import load
from pdserve.kvstore.mooncake.objects import ObjectWriter, decode_head, pieces_of
from pdserve.kvstore.wire import Chunk
from pdserve.security.options import INSECURE, SecurityOptions

logger = logging.getLogger(__name__)

OBJECT_NOT_FOUND = -704
NO_AVAILABLE_HANDLE = -200
"""Mooncake's codes for an absent object and for no room in any segment."""
PIECE_BYTES = 1 << 30
"""Pieces the sender cuts frames into (``StreamTarget.chunk_bytes``): large, so that each
frame's K and V travel as one piece each and a reader keeps them without a copy."""


class MooncakeStoreClient:
    """Put, get, look up and delete KV entries in the Mooncake Store at ``address`` (a
    ``mooncake://`` address, see ``address``); the module doc says how."""

    follows = False
    """Whether a get can follow an entry still being written (no: objects appear whole)."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 10.0,
        local_host: str = "",
        security: SecurityOptions = INSECURE,
        field: str = "kvstore",
    ) -> None:
        """``local_host``: the address other processes reach this one's segment at; default
        the local address of the route to the master. ``security``: kept for the callers
        that take theirs from the store's client (Mooncake's own transfers carry no TLS: run
        it on a private network). The Mooncake package is loaded here (``library.load``),
        refusing the address if it is missing. ``field``: what a refusal of the address names
        (the flag, or a handle's field)."""
        self.address = address
        self.config = MooncakeAddress.parse(address, field)
        if not timeout_s > 0:
            raise InvalidArgumentError("timeout_s", f"must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.chunk_bytes = PIECE_BYTES
        self.local_host = local_host
        self.security = security
        self._library = load(field)
        self._store: Any = None
        self._connecting = asyncio.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="mooncake")
        self._closed = False

    # -- joining the store --------------------------------------------------------------
    async def _joined(self) -> Any:
        if self._store is not None:
            return self._store
        async with self._connecting:
            if self._store is None:
                self._store = await self._join()
        return self._store

    async def _join(self) -> Any:
        if self._closed:
            raise KVTransferError(f"Mooncake store client of {self.address} is closed")
        c = self.config
        # The library retries an unreachable master forever: find out first, within the
        # deadline, and learn the local address the master is reached from.
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(c.master_host, c.master_port), self.timeout_s
            )
        except (OSError, TimeoutError) as err:
            raise KVTransferError(f"Mooncake master {c.master} is unreachable: {err}") from err
        local = self.local_host or writer.get_extra_info("sockname")[0]
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        store = self._library.store_class()
        rc = await self._run(
            "join",
            store.setup,
            local,
            c.metadata,
            c.segment_bytes,
            c.buffer_bytes,
            c.protocol,
            c.devices,
            c.master,
        )
        if rc != 0:
            raise KVTransferError(f"joining the Mooncake Store at {c.master} failed (code {rc})")
        logger.info(
            "joined the Mooncake Store at %s as %s, lending %d bytes",
            c.master, local, c.segment_bytes,
        )  # fmt: skip
        return store

    async def _run(self, what: str, fn: Any, *args: Any) -> Any:
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            raise KVTransferError(
                f"Mooncake {what} at {self.config.master} took more than {self.timeout_s:.3g} s"
            ) from None

    def _failed(self, code: int, what: str) -> PdServeError:
        if code == OBJECT_NOT_FOUND:
            return UnknownRequestError(f"{what}: not in the Mooncake Store at {self.config.master}")
        if code == NO_AVAILABLE_HANDLE:
            return CapacityError(f"{what}: the Mooncake Store at {self.config.master} is full")
        return KVTransferError(f"{what} at Mooncake {self.config.master} failed (code {code})")

    # -- writes -------------------------------------------------------------------------
    async def _put_object(self, key: str, writer: ObjectWriter) -> None:
        parts = writer.finish(key)
        store = await self._joined()
        replicate = self._library.replicate_config(self.config.replicas)
        future = asyncio.get_running_loop().run_in_executor(
            self._pool, self._library.put_parts, store, key, parts, replicate
        )
        try:
            rc = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except (TimeoutError, asyncio.CancelledError) as err:
            # The put goes on in its thread: let it end (bounded), then remove whatever it
            # left, so that a cut hand-off leaves nothing behind.
            await self._undo_put(store, key, future)
            if isinstance(err, TimeoutError):
                raise KVTransferError(
                    f"put {key!r} to Mooncake {self.config.master} took more than "
                    f"{self.timeout_s:.3g} s"
                ) from None
            raise
        if rc != 0:
            raise self._failed(rc, f"put {key!r}")

    async def _undo_put(self, store: Any, key: str, put: asyncio.Future[Any]) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(put), self.timeout_s)
            await self._remove(store, key)
        except (TimeoutError, PdServeError) as err:
            logger.warning("a cut put of %s may stay until evicted: %s", key, err)

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
        """Store ``header`` + ``payload`` under ``key`` (``lease_s`` ignored: see the module)."""
        data = memoryview(payload).cast("B")
        writer = ObjectWriter(header, len(data), cache=cache)
        writer.write(data)
        await self._put_object(key, writer)
        return PutResult(len(header) + len(data), 1, 0.0)

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
        """Collect the pieces as they come, then store them as one object. ``total_bytes``
        (header + data, 0 = unknown) sizes the buffer at once and is checked at the end. If
        ``pieces`` raises, nothing is stored and the error propagates as ``KVTransferError``."""
        data_bytes = total_bytes - len(header) if total_bytes else -1
        writer = ObjectWriter(header, data_bytes, cache=cache)
        count = 0
        try:
            async for piece in pieces:
                if isinstance(piece, tuple):
                    writer.write(piece[0], piece[2] if len(piece) == 3 else b"")
                else:
                    writer.write(piece)
                count += 1
        except PdServeError:
            raise
        except Exception as err:
            raise KVTransferError(f"put {key!r}: its data failed: {err}") from err
        await self._put_object(key, writer)
        return PutResult(len(header) + writer.data_bytes, count, 0.0)

    # -- reads --------------------------------------------------------------------------
    def _read_blocking(self, store: Any, key: str) -> memoryview | int:
        size = store.get_size(key)
        if size < 0:
            return int(size)
        buffer = np.empty(size, dtype=np.uint8)
        got = store.get_into(key, buffer.ctypes.data, size)
        if got < 0:
            return int(got)
        if got != size:
            return -1
        return buffer.data.cast("B").toreadonly()

    async def _read(self, key: str, delete_after_read: bool) -> memoryview:
        store = await self._joined()
        raw = await self._run("get", self._read_blocking, store, key)
        if isinstance(raw, int):
            raise self._failed(raw, f"get {key!r}")
        if delete_after_read:
            await self._remove(store, key)
        return raw

    async def stream(
        self,
        key: str,
        *,
        delete_after_read: bool = False,
        timeout_s: float | None = None,
        follow: bool = False,
    ) -> AsyncGenerator[Chunk, None]:
        """The entry as chunks, cut where its writer cut it: the first carries the header,
        each its data's CRC-32. With ``delete_after_read`` the object is removed once read,
        before the first chunk is yielded. ``follow`` changes nothing (``follows``)."""
        raw = await self._read(key, delete_after_read)
        header, start = decode_head(key, raw)
        pieces = pieces_of(key, raw, start)
        crcs = await asyncio.get_running_loop().run_in_executor(
            self._pool, lambda: [fast_crc32(p) for p in pieces]
        )
        total = len(header) + sum(len(p) for p in pieces)
        if not pieces:
            yield Chunk(seq=0, key=key, header=header, total_bytes=total, last=True)
            return
        for seq, (piece, crc) in enumerate(zip(pieces, crcs, strict=True)):
            yield Chunk(
                seq=seq,
                data=piece,
                crc32=crc,
                last=seq == len(pieces) - 1,
                key=key if seq == 0 else "",
                header=header if seq == 0 else b"",
                total_bytes=total if seq == 0 else 0,
            )

    async def get(
        self, key: str, *, delete_after_read: bool = False, timeout_s: float | None = None
    ) -> bytes:
        """The entry under ``key``: its header followed by its data."""
        raw = await self._read(key, delete_after_read)
        header, start = decode_head(key, raw)
        pieces = pieces_of(key, raw, start)
        return header + b"".join(pieces)

    async def lookup(self, keys: Sequence[str], *, timeout_s: float | None = None) -> int:
        """How many of ``keys``, from the first on, the store holds."""
        if not keys:
            return 0
        store = await self._joined()
        found: list[int] = await self._run("lookup", store.batch_is_exist, list(keys))
        n = 0
        for i, exists in enumerate(found):
            if exists < 0:
                raise KVTransferError(
                    f"lookup of {keys[i]!r} at Mooncake {self.config.master} failed"
                )
            if exists != 1:
                break
            n += 1
        return n

    async def _remove(self, store: Any, key: str) -> bool:
        # force: a read leaves the object leased for a while (``default_kv_lease_ttl``); the
        # owner of a hand-off or a cache entry removes it regardless.
        rc = await self._run("remove", store.remove, key, True)
        if rc == 0:
            return True
        if rc == OBJECT_NOT_FOUND:
            return False
        raise self._failed(rc, f"delete {key!r}")

    async def delete(self, key: str, *, timeout_s: float | None = None) -> bool:
        """Delete ``key``; False if it was absent."""
        return await self._remove(await self._joined(), key)

    async def close(self) -> None:
        """Leave the store (this process's segment and the objects in it go) and stop the
        threads."""
        self._closed = True
        store, self._store = self._store, None
        if store is not None:
            try:
                await self._run("close", store.close)
            except KVTransferError as err:
                logger.warning("leaving the Mooncake Store: %s", err)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> MooncakeStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
