"""``DecodeConnector``: the decode side of every hand-off, its decisions and its resources.

Per ``Decode`` call, ``async with connector.incoming(kv) as incoming`` takes the hand-off in
custody (a read begun early for it, else a fresh receiver of its location) and frees the
transport's copy when the block ends, whatever happened (read-and-deleted, or discarded).
Inside, ``incoming.arrive`` gives the prompt's KV:

* ``store``: the layer stream read from the KV store with ``delete_after_read``, assembled as
  the chunks arrive; ``direct``: the stream the prefill worker pushed into this worker
  (``Decode.Push``, the ``inbox``), assembled as it landed, taken in-process (one naming
  another worker is not here: recompute); ``shm``: the segment on this host (the reader
  unlinks it, or frees its reused slot once the engine imported it); ``nixl``: one-sided
  READs of the prefill worker's registered blocks (``transfer.nixl``), the agent found in its
  heartbeat (``agents``), which it is then notified to free;
* ``native``: nothing to read: the engine (of the same backend) pulls the KV itself as the
  decode starts (TensorRT-LLM's generation-only request);
* ``recompute``: nothing was moved; the prompt is prefilled here with ``max_tokens=1`` and its
  KV exported, exactly as a transfer would have delivered it (a backend whose KV cannot enter
  its engine as bytes recomputes inside its decode instead, and refuses store, direct and
  shm hand-offs, naming ``kv.location``).

Every read is bounded (``--kv-transfer-timeout-s``, or from the payload's size and the
bandwidth measured so far on that link, ``Links``). A timeout, a broken stream, a bad checksum
or a missing entry makes it recompute (``FALLBACK_ERRORS``); a payload of another model
(``KVPayloadMismatchError``) and a bad handle fail the call. A prefix the decode worker's
cache holds (``KVLocation.prefix_tokens``) is joined to what arrived (``prefix.decode``).

The hand-off calls a decode worker serves besides ``Decode`` are the connector's too:
``Decode.Push``/``Drop``/``InboxStat`` (its ``inbox``), ``Decode.Prefetch`` (``prefetch``:
a hand-off read while the prefill computes, ``handoff.prefetch``) and
``Decode.CachedPrefix`` (``cached_prefix``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.backends import EngineBackend, NativeKV, recompute_kv
from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.request import EngineRequest
from pdserve.errors import (
    CapacityError,
    InvalidArgumentError,
    KVPayloadMismatchError,
    KVTransferError,
    UnknownRequestError,
)
from pdserve.handoff.prefetch import PREFETCH_TIMEOUT_S, PREFETCHED, Prefetch, Prefetches
from pdserve.kvstore.backend import StoreClient, open_store
from pdserve.kvstore.mooncake.library import MooncakeUnavailableError
from pdserve.prefix import decode as decode_prefix
from pdserve.security.options import INSECURE, SecurityOptions
from pdserve.transfer.bandwidth import BandwidthMeter
from pdserve.transfer.base import (
    HandoffRecord,
    KVLocation,
    KVReceiver,
    Transport,
    TransportKind,
    TransportRegistry,
)
from pdserve.transfer.links import Links
from pdserve.transfer.shm.handoff import ShmReceiver
from pdserve.transfer.shm.reader import SegmentReader
from pdserve.transfer.shm.slot_mappings import SlotMappings
from pdserve.transfer.stream.inbox import Inbox
from pdserve.transfer.stream.receiver import LocalReceiver, StreamReceiver

if TYPE_CHECKING:  # nixl's modules load only where a nixl hand-off is made
    from pdserve.transfer.nixl.reader import AgentDirectory, NixlReader

logger = logging.getLogger(__name__)

FALLBACK_ERRORS = (KVTransferError, UnknownRequestError, CapacityError)
"""Receive failures after which the worker recomputes instead of failing the request."""


@dataclass(frozen=True, slots=True)
class PrefetchOutcome:
    """What ``DecodeConnector.prefetch`` answers (``PrefetchResponse``)."""

    accepted: bool
    ready: bool = False
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Arrival:
    """The prompt's KV as it reached the decode worker, and how."""

    payload: KVPayload | NativeKV | None
    """None: the backend computes the prompt itself (a recompute it does not export)."""
    record: HandoffRecord
    """The receiver's record (``recompute``, with the reason, when nothing arrived)."""
    transfer_ms: float
    """The receive, a failed attempt included."""
    recompute_ms: float
    """The prompt's prefill here."""


class DecodeConnector:
    """Takes a decode worker's hand-offs in (see the module docstring).

    ``inbox``: the ``direct`` hand-offs prefill workers push into this worker (owned: swept
    and closed with the connector). ``transfer_timeout_s``: bound on each receive (0: from the
    payload's size and the bandwidth measured so far). ``security``: TLS and the internal
    token of the calls to KV stores. ``store_host``: the address other hosts reach this
    process at, for a store that asks (a Mooncake Store's segment; empty: the route to it).
    ``transports``: the receivers to use (default: the real ones, on this connector's
    resources; tests give fakes).
    """

    def __init__(
        self,
        engine: EngineBackend,
        *,
        inbox: Inbox | None = None,
        host: str | None = None,
        store_timeout_s: float = 10.0,
        transfer_timeout_s: float = 0.0,
        security: SecurityOptions = INSECURE,
        store_host: str = "",
        transports: TransportRegistry | None = None,
        agents: AgentDirectory | None = None,
        nixl_bytes: int = 256 * 1024 * 1024,
        nixl_block_bytes: int = 64 * 1024,
    ) -> None:
        """``agents``: where prefill workers publish their NIXL agents (their heartbeats);
        without it, nixl hand-offs are recomputed. ``nixl_bytes``/``nixl_block_bytes``: the
        landing blocks registered with this worker's NIXL agent at its first nixl hand-off."""
        if not transfer_timeout_s >= 0:
            raise InvalidArgumentError(
                "transfer_timeout_s", f"must be >= 0, got {transfer_timeout_s}"
            )
        self.engine = engine
        self.inbox = inbox
        self.host = host or socket.gethostname()
        self.store_timeout_s = store_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.security = security
        self.store_host = store_host
        self.links = Links(self.host)
        self.bandwidth = BandwidthMeter()
        """The live bytes/s of this worker's reads, per (prefill host, transport)."""
        self.prefetches = Prefetches()
        self._stores: dict[str, StoreClient] = {}
        # Checks the K half of shm layers beside the reading thread's V half.
        self._hash_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-hash")
        # Prefill workers' reused shm slots, kept mapped between hand-offs (``transfer.shm.slots``).
        self._slot_maps = SlotMappings()
        self.agents = agents
        self._nixl_sizes = (nixl_bytes, nixl_block_bytes)
        self._nixl_reader: NixlReader | None = None
        self.transports = transports or TransportRegistry(
            {
                TransportKind.SHM: Transport(receiver=self._shm),
                TransportKind.STORE: Transport(receiver=self._stream),
                TransportKind.DIRECT: Transport(receiver=self._stream),
                TransportKind.NIXL: Transport(receiver=self._nixl),
            }
        )
        # Prefill workers ask which prompt prefix this engine caches (Decode.CachedPrefix).
        self._prefix_oracle = decode_prefix.DecodePrefixOracle(engine)

    def _store(self, address: str) -> StoreClient:
        """The client of the store a handle names (``kvstore.backend.open_store``)."""
        client = self._stores.get(address)
        if client is None:
            try:
                client = open_store(
                    address,
                    timeout_s=self.store_timeout_s,
                    security=self.security,
                    local_host=self.store_host,
                    field="kv.store.address",
                )
            except MooncakeUnavailableError as err:  # this worker lacks it: not bad input
                raise KVTransferError(f"store hand-off cannot be read here: {err}") from err
            self._stores[address] = client
        return client

    def _shm(self, location: KVLocation, *, follow: bool = False) -> KVReceiver:
        reader = SegmentReader(
            expected_layout=self.engine.layout, host=self.host, pool=self._hash_pool,
            follow=follow, slots=self._slot_maps,
        )  # fmt: skip
        return ShmReceiver(reader, location)

    def nixl_reader(self) -> NixlReader:
        """This worker's NIXL agent and landing blocks, made (and registered) at the first
        nixl hand-off; ``KVTransferError`` (a recompute) where none can be."""
        if self._nixl_reader is None:
            if self.agents is None:
                raise KVTransferError("nixl hand-off: this worker knows no agent directory")
            from pdserve.transfer.nixl.agent import NixlUnavailableError  # only where used
            from pdserve.transfer.nixl.reader import NixlReader

            size, block = self._nixl_sizes
            try:
                self._nixl_reader = NixlReader(
                    self.agents, num_bytes=size, block_bytes=block, host=self.host
                )
            except NixlUnavailableError as err:
                raise KVTransferError(f"nixl hand-off cannot be read here: {err}") from err
        return self._nixl_reader

    def _nixl(self, location: KVLocation, *, follow: bool = False) -> KVReceiver:
        from pdserve.transfer.nixl.receiver import NixlReceiver

        return NixlReceiver(
            self.nixl_reader, location, expected_layout=self.engine.layout, follow=follow
        )

    def _stream(self, location: KVLocation, *, follow: bool = False) -> KVReceiver:
        """``store``: the entry at the location's KV store; ``direct``: the hand-off pushed
        into this worker's inbox (one pushed elsewhere is not here: recompute)."""
        if not location.address:
            raise InvalidArgumentError(
                f"kv.{location.kind}.address", "must be the endpoint's host:port"
            )
        layout = self.engine.layout
        if location.kind is TransportKind.DIRECT:
            return LocalReceiver(self.inbox, location, expected_layout=layout)
        store = self._store(location.address)
        return StreamReceiver(store, location, expected_layout=layout, follow=follow)

    def _receiver(self, kv: KVLocation, *, follow: bool = False) -> KVReceiver | None:
        """The receiver of ``kv``; ``follow``: one that reads while the writer writes."""
        if kv.kind in (TransportKind.RECOMPUTE, TransportKind.NATIVE):
            return None
        if not self.engine.features.kv_payload:
            raise InvalidArgumentError(
                "kv.location",
                f"the {self.engine.name} backend's KV cannot enter its engine as bytes, so a "
                f"{kv.kind} hand-off cannot reach it",
            )
        return self.transports.receiver(kv, follow=follow)

    # -- Decode.CachedPrefix ---------------------------------------------------------------
    async def cached_prefix(self, query: decode_prefix.PrefixQuery) -> int:
        """Leading blocks of ``query`` this worker's engine caches (``prefix.decode``);
        answered on the engine thread, only a hint."""
        return await self._prefix_oracle(query)

    # -- Decode.Prefetch -------------------------------------------------------------------
    async def prefetch(self, kv: KVLocation) -> PrefetchOutcome:
        """Read a hand-off that is still being written, until its last layer has landed (see
        ``handoff.prefetch``). Not accepted when this location is not one to prefetch (the
        ``Decode`` call reads it). Cancelling this stops the read and leaves the KV."""
        if kv.kind not in PREFETCHED or kv.model_fingerprint != self.engine.fingerprint:
            return PrefetchOutcome(accepted=False)
        if kv.kind is TransportKind.STORE and not kv.address:
            raise InvalidArgumentError("kv.store.address", "must be the store's host:port")
        try:
            if kv.kind is TransportKind.STORE and not self._store(kv.address).follows:
                return PrefetchOutcome(accepted=False)  # its entries appear whole: read then
            receiver = self._receiver(kv, follow=True)  # holds nothing until it receives
        except KVTransferError:  # not readable here: the Decode call recomputes
            return PrefetchOutcome(accepted=False)
        if receiver is None or not self.prefetches.start(kv, receiver, PREFETCH_TIMEOUT_S):
            return PrefetchOutcome(accepted=False)
        try:
            reason = await self.prefetches.wait(kv.request_id)
        except asyncio.CancelledError:
            await self.prefetches.cancel(kv.request_id)
            raise
        return PrefetchOutcome(accepted=True, ready=not reason, reason=reason)

    # -- Decode ----------------------------------------------------------------------------
    @asynccontextmanager
    async def incoming(self, kv: KVLocation) -> AsyncIterator[Incoming]:
        """The hand-off at ``kv``, in custody for this block: its read begun early (a
        prefetch of this very location), else a fresh receiver; the transport's copy is freed
        when the block ends (a no-op once a read consumed it)."""
        prefetch = await self.prefetches.take(kv)
        unreadable = ""
        try:
            receiver = prefetch.receiver if prefetch is not None else self._receiver(kv)
        except KVTransferError as err:  # this worker cannot read it (lacks a package): recompute
            receiver, unreadable = None, f"{kv.kind} receive failed: {err}"
        try:
            yield Incoming(self, kv, receiver, prefetch, unreadable)
        finally:
            if receiver is not None:
                await receiver.discard()

    async def sweep(self) -> None:
        """Periodic: drop prefetches that no Decode call took in time, pushed hand-offs past
        their lease, and mappings of shm slots their writer dropped (they hold its memory)."""
        await self.prefetches.sweep()
        if self.inbox is not None:
            self.inbox.sweep()
        self._slot_maps.sweep()

    async def close(self) -> None:
        """Drop the prefetches and the pushed hand-offs, close the KV store connections."""
        await self.prefetches.close()
        if self.inbox is not None:
            self.inbox.close()
        self._hash_pool.shutdown(wait=True)
        self._slot_maps.close()
        stores, self._stores = self._stores, {}
        for client in stores.values():
            await client.close()
        if self._nixl_reader is not None:
            self._nixl_reader.close()
        if self.agents is not None:
            await self.agents.close()


class Incoming:
    """One hand-off on the decode side, in custody (``DecodeConnector.incoming``)."""

    def __init__(
        self,
        connector: DecodeConnector,
        kv: KVLocation,
        receiver: KVReceiver | None,
        prefetch: Prefetch | None,
        unreadable: str = "",
    ) -> None:
        """``unreadable``: why this worker could not make a receiver (it recomputes)."""
        self.connector = connector
        self.kv = kv
        self.receiver = receiver
        self.prefetch = prefetch
        self.unreadable = unreadable

    async def arrive(self, request: EngineRequest) -> Arrival:
        """The KV of the request's prompt: received (or its prefetch waited for), or
        recomputed when nothing was sent or the receive failed."""
        request_id, prompt_ids = request.request_id, request.prompt_ids
        kv, engine = self.kv, self.connector.engine
        # A recompute handle moves no KV: one without a fingerprint (a migrated colocated
        # request) has nothing to mismatch.
        unnamed = kv.kind is TransportKind.RECOMPUTE and not kv.model_fingerprint
        if kv.model_fingerprint != engine.fingerprint and not unnamed:
            raise KVPayloadMismatchError(
                f"KV handle fingerprint {kv.model_fingerprint!r} differs from this "
                f"worker's {engine.fingerprint!r}"
            )
        if kv.prefix_tokens + kv.num_tokens != len(prompt_ids):
            raise InvalidArgumentError(
                "kv.num_tokens",
                f"{kv.prefix_tokens} + {kv.num_tokens}, but the prompt has "
                f"{len(prompt_ids)} tokens",
            )
        if kv.kind is TransportKind.NATIVE:  # the engine pulls the KV as the decode starts
            if kv.native is None:
                raise InvalidArgumentError("kv.native", "a native location needs its handle")
            return Arrival(kv.native, HandoffRecord(TransportKind.NATIVE.value), 0.0, 0.0)
        reason = self.unreadable or kv.reason or "nothing was sent"
        transfer_ms = 0.0
        if self.receiver is not None:
            start = time.perf_counter()
            try:
                payload = await self._receive(prompt_ids, request.tenant)
            except FALLBACK_ERRORS as err:
                transfer_ms = (time.perf_counter() - start) * 1000.0
                reason = f"{kv.kind} receive failed: {err}"
                logger.warning("%s: %s; recomputing", request_id, reason)
            else:
                waited = (time.perf_counter() - start) * 1000.0
                prefetched = self.prefetch is not None
                record = self.receiver.record.received(
                    compression=self.receiver.compression, wait_ms=waited if prefetched else None
                )
                if not prefetched:  # a prefetch's read is paced by the prefill, not the link
                    self.connector.links.observe(kv.host or kv.address, record)
                # Its bytes crossed the link all the same.
                self.connector.bandwidth.record_handoff(kv.host or kv.address, record)
                return Arrival(payload, record, waited, 0.0)
        record = HandoffRecord(TransportKind.RECOMPUTE.value, fallback_reason=reason)
        if not engine.features.kv_payload:  # the backend recomputes as it decodes
            return Arrival(None, record, transfer_ms, 0.0)
        start = time.perf_counter()
        payload = await recompute_kv(engine, request)
        return Arrival(payload, record, transfer_ms, (time.perf_counter() - start) * 1000.0)

    async def _receive(self, prompt_ids: Sequence[int], tenant: str) -> KVPayload:
        """The payload, within the link's bound; a prefetch: only its tail is left."""
        kv, receiver, c = self.kv, self.receiver, self.connector
        assert receiver is not None
        timeout = c.links.timeout_s(
            kv.host or kv.address, kv.kind, kv.num_bytes, c.transfer_timeout_s
        )
        if self.prefetch is not None:
            payload = await asyncio.wait_for(self.prefetch.task, timeout)
        else:
            payload = await receiver.receive(timeout)
        if kv.prefix_tokens:  # the rest of the prompt; its prefix is in our cache
            payload = await decode_prefix.join_cached_prefix(
                c.engine, payload, prompt_ids, kv.prefix_tokens, tenant
            )
        return payload
