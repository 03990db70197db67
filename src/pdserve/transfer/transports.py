"""The registries the hand-off's connectors choose their transports from, bound to their
resources.

``senders`` (a prefill worker): ``store``/``direct`` (``stream.StreamSender``, into the KV
store or pushed into the decode worker) and ``shm`` (``shm.ShmSender``); ``receivers`` (a
decode worker): ``store`` (``stream.StreamReceiver``), ``direct`` (``stream.LocalReceiver``:
the hand-off pushed into this worker's ``stream.inbox.Inbox``) and ``shm``
(``shm.ShmReceiver``). The resources (connections, threads,
reused shm slots) are the connector's (``pdserve.handoff``): it owns, shares and closes them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from pdserve.engine.kv_payload import KVLayout
from pdserve.errors import InvalidArgumentError
from pdserve.kvstore.client import KVStoreClient
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
from pdserve.transfer.stream.inbox import Inbox
from pdserve.transfer.stream.receiver import LocalReceiver, StreamReceiver
from pdserve.transfer.stream.sender import StreamSender, StreamTarget


@dataclass(frozen=True, slots=True)
class SendSide:
    """What a prefill worker's senders use."""

    store: KVStoreClient
    """The KV store (``store``)."""
    endpoint: Callable[[str], StreamTarget]
    """A decode worker's ``Decode.Push``, by address (``direct``: ``stream.push.PushClient``)."""
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

    def stream(kind: TransportKind, client: Callable[[str], StreamTarget]) -> Transport:
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
    """The KV store, by address."""
    expected_layout: KVLayout
    """The decode engine's: a payload of another model or dtype is refused."""
    host: str
    inbox: Inbox | None = None
    """The ``direct`` hand-offs prefill workers pushed into this worker (``Decode.Push``)."""
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
        if not location.address:
            raise InvalidArgumentError(
                f"kv.{location.kind}.address", "must be the endpoint's host:port"
            )
        if location.kind is TransportKind.DIRECT:  # pushed here (else not here: recompute)
            return LocalReceiver(side.inbox, location, expected_layout=side.expected_layout)
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
