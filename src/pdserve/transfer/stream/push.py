"""``PushClient``: the ``direct`` sender's way into a decode worker (``Decode.Push``).

The same chunk stream as a ``KVStore.Put`` (``kvstore.client.send_pieces``, the KV chunk
codec of ``kvstore.wire``), sent to the decode worker's ``Decode`` service, which assembles it
as it lands (``inbox.Inbox``); ``delete`` is ``Decode.Drop``. It has the ``put_stream`` and
``delete`` of ``KVStoreClient`` that ``StreamSender`` uses (``sender.StreamTarget``), so one
sender serves both ``store`` and ``direct``.

Failures come back as ``KVStoreClient``'s do: ``KVTransferError`` (a bad frame, a broken or
refused stream), ``CapacityError`` (the decode worker's inbox is full), ``UnknownRequestError``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable

from grpc.aio import AioRpcError

from pdserve.errors import InvalidArgumentError
from pdserve.kvstore.chunks import DEFAULT_CHUNK_BYTES
from pdserve.kvstore.client import (
    CHANNEL_OPTIONS,
    Bytes,
    Piece,
    PutResult,
    send_pieces,
    translate_error,
)
from pdserve.kvstore.wire import chunk_stream_call
from pdserve.security.options import INSECURE, SecurityOptions
from pdserve.telemetry import tracing
from pdserve.v1 import decode_pb2_grpc, kvstore_pb2

PUSH_METHOD = "/pdserve.v1.Decode/Push"


class PushClient:
    """``Decode.Push`` and ``Decode.Drop`` at the decode worker at ``address``."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 10.0,
        security: SecurityOptions = INSECURE,
    ) -> None:
        """``timeout_s``: the deadline of ``delete`` (a push lasts as long as its producer).
        The calls carry the process-wide tracing's interceptors."""
        if not address:
            raise InvalidArgumentError("address", "must be host:port")
        if not timeout_s > 0:
            raise InvalidArgumentError("timeout_s", f"must be > 0, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self.chunk_bytes = DEFAULT_CHUNK_BYTES
        self._channel = security.aio_channel(
            address, options=CHANNEL_OPTIONS, interceptors=tracing.client_interceptors()
        )
        self._push = chunk_stream_call(self._channel, PUSH_METHOD)  # without protobuf's copies
        self._stub = decode_pb2_grpc.DecodeStub(self._channel)

    async def put_stream(
        self,
        key: str,
        pieces: AsyncIterable[Bytes | Piece],
        *,
        header: bytes = b"",
        total_bytes: int = 0,
        lease_s: float = 0.0,
        timeout_s: float | None = None,
    ) -> PutResult:
        """Push the pieces as they come (see ``send_pieces``); returns once the decode worker
        holds the whole hand-off, checked."""
        return await send_pieces(
            self._push,
            key,
            pieces,
            header=header,
            total_bytes=total_bytes,
            lease_s=lease_s,
            timeout_s=timeout_s,
            chunk_bytes=self.chunk_bytes,
            what=f"push {key!r} to {self.address}",
        )

    async def delete(self, key: str, *, timeout_s: float | None = None) -> bool:
        """Drop the pushed hand-off under ``key``; False if the decode worker does not hold it."""
        try:
            resp: kvstore_pb2.DeleteResponse = await self._stub.Drop(
                kvstore_pb2.DeleteRequest(key=key), timeout=timeout_s or self.timeout_s
            )
        except AioRpcError as err:
            raise translate_error(err, f"drop {key!r} at {self.address}") from err
        return resp.deleted

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> PushClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
