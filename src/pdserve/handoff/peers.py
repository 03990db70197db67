"""``DecodePeers``: a prefill worker's connections to the decode workers it hands off to.

Per decode worker address, one ``Decode`` channel for the two calls around a hand-off and one
``PushClient`` (``transfer.stream.push``) for the ``direct`` stream itself:

* ``cached_prefix``: ``Decode.CachedPrefix``, which leading blocks of a prompt it caches
  (``prefix.decode``); every call has a deadline (``timeout_s``), and a failed one comes back
  as ``KVTransferError``, which ``prefix.decode.ask`` turns into "nothing cached";
* ``announce``: ``Decode.Prefetch``, a hand-off announced as it begins (``handoff.prefetch``);
  no deadline (it lasts as long as the prefill; the commit bounds the wait and cancels it);
* ``push``: the ``direct`` transport's target (``Decode.Push``, ``Decode.Drop``).
"""

from __future__ import annotations

import grpc
from grpc.aio import AioRpcError

from pdserve.convert.kv import handle_to_proto
from pdserve.errors import InvalidArgumentError, KVTransferError
from pdserve.kvstore.client import CHANNEL_OPTIONS
from pdserve.prefix.convert import cached_blocks_from_proto, prefix_query_to_proto
from pdserve.prefix.decode import PrefixQuery
from pdserve.security.options import INSECURE, SecurityOptions
from pdserve.telemetry import tracing
from pdserve.transfer.base import KVLocation
from pdserve.transfer.stream.push import PushClient
from pdserve.v1 import decode_pb2, decode_pb2_grpc


class DecodePeers:
    """Decode workers' stubs and push clients by address (module docstring); ``security``:
    TLS and the internal token of the calls (``pdserve.security``)."""

    def __init__(self, *, timeout_s: float = 10.0, security: SecurityOptions = INSECURE) -> None:
        if not timeout_s > 0:
            raise InvalidArgumentError("timeout_s", f"must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.security = security
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._pushes: dict[str, PushClient] = {}

    def _stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        if not address:
            raise InvalidArgumentError("address", "must be host:port")
        channel = self._channels.get(address)
        if channel is None:
            # The KV store client's options: a decode worker restarted on its address is
            # asked again within a second, as its endpoint is streamed to again.
            channel = self._channels[address] = self.security.aio_channel(
                address, options=CHANNEL_OPTIONS, interceptors=list(tracing.client_interceptors())
            )
        return decode_pb2_grpc.DecodeStub(channel)

    def push(self, address: str) -> PushClient:
        """The ``direct`` target at ``address``."""
        client = self._pushes.get(address)
        if client is None:
            client = self._pushes[address] = PushClient(
                address, timeout_s=self.timeout_s, security=self.security
            )
        return client

    async def cached_prefix(self, address: str, query: PrefixQuery) -> int:
        """Leading blocks of ``query`` the decode worker at ``address`` holds."""
        stub = self._stub(address)
        try:
            response: decode_pb2.CachedPrefixResponse = await stub.CachedPrefix(
                prefix_query_to_proto(query), timeout=self.timeout_s
            )
        except AioRpcError as err:
            raise KVTransferError(
                f"cached-prefix query on {address} failed with {err.code().name}: "
                f"{err.details() or ''}"
            ) from err
        return cached_blocks_from_proto(response, query)

    async def announce(self, address: str, location: KVLocation) -> str:
        """Announce the hand-off being written to ``location`` and wait for the decode
        worker's read: "" once it holds the checked KV, else why not. ``AioRpcError`` when
        the call fails."""
        request = decode_pb2.PrefetchRequest(kv=handle_to_proto(location))
        response = await self._stub(address).Prefetch(request)
        if not response.accepted:
            return "declined"
        return "" if response.ready else response.reason or "not ready"

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        pushes, self._pushes = self._pushes, {}
        for channel in channels.values():
            await channel.close()
        for push in pushes.values():
            await push.close()
