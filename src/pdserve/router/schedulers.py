"""The scheduler replicas a router places requests through.

Scheduler replicas share nothing but Redis: each reserves with the same optimistic re-check
(WATCH/MULTI/EXEC), so any replica may answer any call of any request (Assign, Renew,
Release). The router spreads its calls over them in turn, which adds their capacity, and a
call that finds one replica unreachable goes to the next (``cycle``), so that a replica that
dies (or restarts) costs no request while another is up. When none answers, the call waits
for one (``router.scheduler_wait``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from pdserve.errors import InvalidArgumentError
from pdserve.router.channels import ChannelPool
from pdserve.v1 import scheduler_pb2_grpc


def parse_replicas(value: str | Sequence[str], flag: str = "--scheduler") -> tuple[str, ...]:
    """``host:port[,host:port...]`` (or a list of them) as a tuple; refused when empty or
    repeated, naming ``flag``."""
    items = value.split(",") if isinstance(value, str) else list(value)
    addresses = tuple(a.strip() for a in items if a.strip())
    if not addresses:
        raise InvalidArgumentError(flag, "needs at least one scheduler address (host:port)")
    if len(set(addresses)) != len(addresses):
        raise InvalidArgumentError(flag, f"names a scheduler twice: {','.join(addresses)}")
    return addresses


class SchedulerReplicas:
    """Round robin over the replicas (see the module docstring)."""

    def __init__(self, addresses: str | Sequence[str], channels: ChannelPool) -> None:
        self.addresses = parse_replicas(addresses)
        self.channels = channels
        self._turn = itertools.count()

    def __len__(self) -> int:
        return len(self.addresses)

    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        """The next replica's stub: each call asks the one after the previous call's."""
        return self._stub(next(self._turn))

    def cycle(self) -> Iterator[scheduler_pb2_grpc.SchedulerStub]:
        """Stubs for the tries of one call, without end: the next replica's first, then each
        other replica's in order, then round again. A call that fails over so tries every
        replica once before any of them twice, however many other calls take their turns
        meanwhile."""
        for turn in itertools.count(next(self._turn)):
            yield self._stub(turn)

    def _stub(self, turn: int) -> scheduler_pb2_grpc.SchedulerStub:
        address = self.addresses[turn % len(self.addresses)]
        return scheduler_pb2_grpc.SchedulerStub(self.channels.get(address))
