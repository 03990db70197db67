"""A small pool of gRPC channels, one per downstream address, shared by all requests.

A channel multiplexes any number of concurrent calls over one HTTP/2 connection, so opening
one per request would only add connection set-up latency and file descriptors. The pool is
bounded: when a new address would exceed ``max_size``, the least recently used channel is
closed after a grace period (``EVICT_GRACE_S``) that lets its in-flight calls finish.

Every channel gets the pool's client interceptors: by default those of the process-wide
tracing (``pdserve.telemetry.tracing.client_interceptors``), so that each call carries the
request's trace context as ``traceparent`` metadata; none when tracing is off. Channels are
built by the pool's ``SecurityOptions`` (TLS, and the cluster's internal token on every call).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

import grpc

from pdserve.errors import InvalidArgumentError
from pdserve.rpc.server import CHANNEL_OPTIONS
from pdserve.security.options import INSECURE, SecurityOptions
from pdserve.telemetry import tracing

EVICT_GRACE_S = 30.0


class ChannelPool:
    """``get(address)`` returns the cached channel to ``address``, creating it on first use."""

    def __init__(
        self,
        *,
        max_size: int = 64,
        interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
        security: SecurityOptions = INSECURE,
    ) -> None:
        """``interceptors`` None: the process-wide tracing's (read once, here)."""
        if max_size < 1:
            raise InvalidArgumentError("max_size", f"must be >= 1, got {max_size}")
        self.max_size = max_size
        self.security = security
        self._interceptors = list(
            tracing.client_interceptors() if interceptors is None else interceptors
        )
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        # Evicted channels still draining; kept so that close() can wait for them.
        self._closing: set[asyncio.Task[None]] = set()
        self.created = 0
        """Channels opened so far (a channel per request would make this grow with traffic)."""

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is not None:
            self._channels.move_to_end(address)
            return channel
        channel = self.security.aio_channel(
            address, options=CHANNEL_OPTIONS, interceptors=self._interceptors
        )
        self._channels[address] = channel
        self.created += 1
        while len(self._channels) > self.max_size:
            _, old = self._channels.popitem(last=False)
            task = asyncio.create_task(old.close(EVICT_GRACE_S), name="pdserve-channel-close")
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return channel

    def __len__(self) -> int:
        return len(self._channels)

    def __contains__(self, address: object) -> bool:
        return address in self._channels

    async def close(self, grace_s: float | None = None) -> None:
        """Close every channel (in-flight calls get ``grace_s``), evicted ones included."""
        channels = list(self._channels.values())
        self._channels.clear()
        await asyncio.gather(*(c.close(grace_s) for c in channels), *self._closing)
