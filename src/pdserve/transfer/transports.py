"""The registries the worker roles choose their transports from, bound to their resources.

``senders`` (a prefill worker): ``store``/``direct`` (``stream.StreamSender``) and ``shm``
(``shm.ShmSender``); ``receivers`` (a decode worker): ``store``/``direct``
(``stream.StreamReceiver``, or ``stream.LocalReceiver`` for a ``direct`` hand-off into this
worker's own endpoint) and ``shm`` (``shm.ShmReceiver``). The resources (connections, threads,
reused shm slots) are the worker's: it owns, shares and closes them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from pdserve.engine.kv_payload import KVLayout
from pdserve.errors import InvalidArgumentError
from pdserve.kvstore.client import KVStoreClient
from pdserve.kvstore.store import KVStore
from pdserve.transfer.base import (
    KVLocation,
    KVReceiver,
    KVSender,
    Transport,
    TransportKind,
    TransportRegistry,
)
from pdserve.transfer.compress import Compression
from pdserve.transfer.faults import SendFaults
from pdserve.transfer.shm.handoff import ShmReceiver, ShmSender
from pdserve.transfer.shm.reader import SegmentReader
from pdserve.transfer.shm.slots import SlotMappings, SlotPool
from pdserve.transfer.shm.writer import SegmentWriter
from pdserve.transfer.stream.receiver import LocalReceiver, StreamReceiver
from pdserve.transfer.stream.sender import StreamSender


@dataclass(frozen=True, slots=True)
class SendSide:
    """What a prefill worker's senders use."""

    store: KVStoreClient
    """The KV store (``store``)."""
    endpoint: Callable[[str], KVStoreClient]
    """A decode worker's own KVStore endpoint, by address (``direct``)."""
    host: str
    lease_s: float
    compression: Compression
    sealer: Executor
    """The one thread that seals the large frames of every stream, in the order taken."""
    shm_pool: Executor | None = None
    """Copies each layer's K beside the engine thread's V (``SegmentWriter.pool``)."""
    shm_closer: Executor | None = None
    """Unmaps sealed segments off the request's path (``SegmentWriter.closer``)."""
    shm_slots: SlotPool | None = None
    faults: SendFaults | None = None


def senders(side: SendSide) -> TransportRegistry:
    """The prefill worker's registry: a fresh sender per hand-off."""

    def shm(peer_address: str) -> KVSender:
        writer = SegmentWriter(
            host=side.host, pool=side.shm_pool, closer=side.shm_closer, slots=side.shm_slots
        )
        return ShmSender(writer, faults=side.faults)

    def stream(kind: TransportKind, client: Callable[[str], KVStoreClient]) -> Transport:
        def make(peer_address: str) -> KVSender:
            return StreamSender(
                client(peer_address),
                kind,
                lease_s=side.lease_s,
                compression=side.compression,
                sealer=side.sealer,
                faults=side.faults,
            )

        return Transport(sender=make)

    registry = TransportRegistry()
    registry.register(TransportKind.SHM, Transport(sender=shm))
    registry.register(TransportKind.STORE, stream(TransportKind.STORE, lambda _: side.store))
    registry.register(TransportKind.DIRECT, stream(TransportKind.DIRECT, side.endpoint))
    return registry


@dataclass(frozen=True, slots=True)
class ReceiveSide:
    """What a decode worker's receivers use."""

    store: Callable[[str], KVStoreClient]
    """A KVStore endpoint (the store, or another worker's), by address."""
    expected_layout: KVLayout
    """The decode engine's: a payload of another model or dtype is refused."""
    host: str
    inbox: KVStore | None = None
    """This worker's own endpoint, into which prefill workers write ``direct`` hand-offs."""
    address: str = ""
    """Where ``inbox`` is served."""
    hash_pool: Executor | None = None
    """Checks the K half of shm layers beside the reading thread's V half."""
    slot_maps: SlotMappings | None = None


def receivers(side: ReceiveSide) -> TransportRegistry:
    """The decode worker's registry: a fresh receiver per location."""

    def shm(location: KVLocation, *, follow: bool = False) -> KVReceiver:
        reader = SegmentReader(
            expected_layout=side.expected_layout,
            host=side.host,
            pool=side.hash_pool,
            follow=follow,
            slots=side.slot_maps,
        )
        return ShmReceiver(reader, location)

    def stream(location: KVLocation, *, follow: bool = False) -> KVReceiver:
        local = side.inbox is not None and location.address == side.address
        if location.kind is TransportKind.DIRECT and local and side.inbox is not None:
            return LocalReceiver(side.inbox, location, expected_layout=side.expected_layout)
        if not location.address:
            raise InvalidArgumentError(
                f"kv.{location.kind}.address", "must be the endpoint's host:port"
            )
        return StreamReceiver(
            side.store(location.address),
            location,
            expected_layout=side.expected_layout,
            follow=follow,
        )

    registry = TransportRegistry()
    registry.register(TransportKind.SHM, Transport(receiver=shm))
    registry.register(TransportKind.STORE, Transport(receiver=stream))
    registry.register(TransportKind.DIRECT, Transport(receiver=stream))
    return registry
