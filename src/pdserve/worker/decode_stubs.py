"""``Decode`` stubs of the decode workers a prefill worker hands off to: the ``Announce``
functions of ``worker.announce`` (``Decode.Prefetch`` calls), one channel per address."""

from __future__ import annotations

import grpc

from pdserve.convert.kv import handle_to_proto
from pdserve.security.options import INSECURE, SecurityOptions
from pdserve.telemetry import tracing
from pdserve.transfer.base import KVLocation
from pdserve.v1 import decode_pb2, decode_pb2_grpc
from pdserve.worker.announce import Announce


class DecodeStubs:
    """``Decode`` stubs by decode worker address, for announcements."""

    def __init__(self, security: SecurityOptions = INSECURE) -> None:
        self.security = security
        self._channels: dict[str, grpc.aio.Channel] = {}

    def announcer(self, address: str) -> Announce:
        channel = self._channels.get(address)
        if channel is None:
            interceptors = tracing.client_interceptors()
            channel = self._channels[address] = self.security.aio_channel(
                address, interceptors=list(interceptors)
            )
        stub = decode_pb2_grpc.DecodeStub(channel)

        async def announce(location: KVLocation) -> str:
            # No deadline: the call lasts as long as the prefill; ``Announced.commit`` bounds
            # the wait for its answer and cancels it.
            request = decode_pb2.PrefetchRequest(kv=handle_to_proto(location))
            response = await stub.Prefetch(request)
            if not response.accepted:
                return "declined"
            return "" if response.ready else response.reason or "not ready"

        return announce

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
