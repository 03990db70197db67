"""``DecodePrefixClients``: ``Decode.CachedPrefix`` calls to the decode workers a prefill
worker hands off to, one channel per address (see ``prefix.decode``).

Every call has a deadline (``timeout_s``); a failed call comes back as ``KVTransferError``,
which ``prefix.decode.ask`` turns into "nothing cached" (the whole prompt moves).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc.aio import AioRpcError

from pdserve.errors import InvalidArgumentError, KVTransferError
from pdserve.kvstore.client import CHANNEL_OPTIONS
from pdserve.prefix.convert import cached_blocks_from_proto, prefix_query_to_proto
from pdserve.prefix.decode import PrefixQuery
from pdserve.security.options import INSECURE, SecurityOptions
from pdserve.telemetry import tracing
from pdserve.v1 import decode_pb2, decode_pb2_grpc


class DecodePrefixClients:
    """``Decode`` stubs by decode worker address, for cached-prefix queries."""

    def __init__(
        self,
        *,
        timeout_s: float = 10.0,
        security: SecurityOptions = INSECURE,
        interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
    ) -> None:
        """``interceptors`` None: the process-wide tracing's (CLIENT spans, ``traceparent``).
        ``security``: TLS and the internal token of the calls (``pdserve.security``)."""
        if not timeout_s > 0:
            raise InvalidArgumentError("timeout_s", f"must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.security = security
        self._interceptors = interceptors
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        channel = self._channels.get(address)
        if channel is None:
            interceptors = self._interceptors
            if interceptors is None:
                interceptors = tracing.client_interceptors()
            # The KV store client's options: a decode worker restarted on its address is
            # asked again within a second, as its endpoint is streamed to again.
            channel = self._channels[address] = self.security.aio_channel(
                address, options=CHANNEL_OPTIONS, interceptors=list(interceptors)
            )
        return decode_pb2_grpc.DecodeStub(channel)

    async def cached_prefix(self, address: str, query: PrefixQuery) -> int:
        """Leading blocks of ``query`` the decode worker at ``address`` holds."""
        if not address:
            raise InvalidArgumentError("address", "must be host:port")
        try:
            response: decode_pb2.CachedPrefixResponse = await self._stub(address).CachedPrefix(
                prefix_query_to_proto(query), timeout=self.timeout_s
            )
        except AioRpcError as err:
            raise KVTransferError(
                f"cached-prefix query on {address} failed with {err.code().name}: "
                f"{err.details() or ''}"
            ) from err
        return cached_blocks_from_proto(response, query)

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
