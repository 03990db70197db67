"""``PrefillConnector``: the prefill side of every hand-off, its decisions and its resources.

Per request, for the prefill worker:

1. ``plan``: the ``HandoffPlan``, decided once. The decode worker the request names is
   checked against its reservation (``assignment.AssignedDecode``): an address the scheduler
   did not assign is not used (the KV then goes through the KV store). The transport is the
   forced one or the policy's (``plan.choose_kind``, on this host's ``Links``; the engine's
   own hand-off on a backend whose KV cannot leave it). A moving hand-off to a known decode
   worker first asks it which leading blocks of the prompt it caches (``prefix.decode``):
   those are left out.
2. ``open``: the plan's sender, begun (the shm segment or the stream exists before the engine
   starts), as an ``Outgoing``; a transport that refuses it (shm full, ...) holds nothing, and
   the plan becomes ``recompute``. The prefill runs with ``Outgoing.layer_hook``, and
   ``Outgoing.hand_over`` commits or falls back (``outgoing``).

What it owns, shared by its hand-offs and closed by ``close``: the transports (a
``TransportRegistry`` bound to the resources below, a fresh sender per hand-off: ``store``
and ``direct`` a ``StreamSender`` into the KV store or pushed into the decode worker, ``shm``
a ``ShmSender``, ``nixl`` a ``NixlSender`` into the NIXL-registered block pool, made at start
with ``--transport nixl``), the copy, unmapping and sealing threads, the reused shm segments
(``SlotPool``, swept by ``sweep``), the decode workers' connections (``peers.DecodePeers``)
and the reservation check.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from pdserve.backends import EngineBackend
from pdserve.engine.request import EngineRequest
from pdserve.errors import CapacityError, KVTransferError
from pdserve.handoff.assignment import AssignedDecode
from pdserve.handoff.outgoing import Outgoing
from pdserve.handoff.peers import DecodePeers
from pdserve.handoff.plan import (
    AUTO,
    HandoffPlan,
    HandoffRoute,
    TransferOptions,
    choose_kind,
    in_engine_kind,
    parse_transport,
)
from pdserve.kvstore.backend import StoreClient
from pdserve.prefix import decode as decode_prefix
from pdserve.transfer.bandwidth import BandwidthMeter
from pdserve.transfer.base import (
    KVLocation,
    KVSender,
    Transport,
    TransportKind,
    TransportRegistry,
)
from pdserve.transfer.compress import Compression
from pdserve.transfer.links import Links
from pdserve.transfer.shm.handoff import ShmSender
from pdserve.transfer.shm.slots import SlotPool, slot_budget
from pdserve.transfer.shm.writer import SegmentWriter
from pdserve.transfer.stream.sender import StreamSender, StreamTarget

if TYPE_CHECKING:  # nixl's modules load only where a nixl hand-off is made
    from pdserve.transfer.nixl.pool import NixlPool

logger = logging.getLogger(__name__)


class PrefillConnector:
    """Plans and carries out a prefill worker's hand-offs (see the module docstring)."""

    def __init__(
        self,
        engine: EngineBackend,
        store: StoreClient,
        *,
        host: str | None = None,
        options: TransferOptions | None = None,
        links: Links | None = None,
        assignments: AssignedDecode | None = None,
        transports: TransportRegistry | None = None,
    ) -> None:
        """``store``: the KV store (``store`` hand-offs; its deadline and security serve the
        calls to decode workers too). ``links``: what this host knows of its KV links (a sim
        worker's modelled ones; default: measured). ``assignments``: use a decode address
        only if the request's reservation holds it; None (no scheduler): any address is used.
        ``transports``: the senders to use (default: the real ones, on this connector's
        resources; tests give fakes)."""
        self.engine = engine
        self.host = host or socket.gethostname()
        self.options = o = options or TransferOptions()
        self.links = links or Links(self.host)
        self.bandwidth = BandwidthMeter()
        """The live bytes/s of this worker's sends, per (decode host, transport)."""
        self.assignments = assignments
        self.peers = DecodePeers(timeout_s=store.timeout_s, security=store.security)
        # shm: one thread copies each layer's K beside the engine thread's V; another unmaps
        # sealed segments off the request's path.
        self._shm_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shm-copy")
        self._shm_closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shm-unmap")
        # shm segments kept mapped and reused: neither side builds page tables per hand-off.
        budget = slot_budget(o.shm_slot_bytes)
        self._shm_slots = SlotPool(budget, lease_s=o.lease_s) if budget else None
        # store/direct: one thread seals the large frames of every stream, in the order taken.
        self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-seal")
        # nixl: KV blocks registered with a NIXL agent once, for the worker's life.
        self.nixl: NixlPool | None = None
        if o.nixl_pool and transports is None:
            from pdserve.transfer.nixl.pool import NixlPool  # loaded only where it is used

            self.nixl = NixlPool(
                num_bytes=o.nixl_pool, block_bytes=o.nixl_block_bytes,
                lease_s=o.lease_s, host=self.host,
            )  # fmt: skip
        self.transports = transports or TransportRegistry(
            {
                TransportKind.SHM: Transport(sender=self._shm),
                TransportKind.STORE: self._stream(TransportKind.STORE, lambda _: store),
                TransportKind.DIRECT: self._stream(TransportKind.DIRECT, self.peers.push),
                **({TransportKind.NIXL: Transport(sender=self._nixl)} if self.nixl else {}),
            }
        )

    @property
    def kv_agent(self) -> tuple[str, str]:
        """What the heartbeat publishes of the NIXL agent: its descriptor and fingerprint
        ("", "" without one)."""
        if self.nixl is None:
            return "", ""
        return self.nixl.published, self.nixl.fingerprint

    def _nixl(self, peer_address: str) -> KVSender:
        from pdserve.transfer.nixl.sender import NixlSender

        assert self.nixl is not None
        return NixlSender(self.nixl, faults=self.options.faults)

    def _shm(self, peer_address: str) -> KVSender:
        writer = SegmentWriter(
            host=self.host, pool=self._shm_pool, closer=self._shm_closer, slots=self._shm_slots
        )
        return ShmSender(writer, faults=self.options.faults)

    def _stream(self, kind: TransportKind, target: Callable[[str], StreamTarget]) -> Transport:
        """The layer stream into ``target(peer_address)``: the KV store, or the decode
        worker's ``Decode.Push``."""
        o = self.options

        def sender(peer_address: str) -> KVSender:
            return StreamSender(
                target(peer_address), kind, lease_s=o.lease_s, compression=o.compression,
                sealer=self._sealer, faults=o.faults,
            )  # fmt: skip

        return Transport(sender=sender)

    async def plan(self, request: EngineRequest, route: HandoffRoute) -> HandoffPlan:
        """The hand-off of one prefill: the scheduler's decode worker (``route``, under the
        request's reservation), the transport asked for (``route.transport``: "" or ``auto``
        for the policy's), and this worker's settings."""
        request_id, prompt_ids = request.request_id, request.prompt_ids
        max_tokens, tenant = request.params.max_tokens, request.tenant
        decode_address, decode_host = route.decode_address, route.decode_host
        if decode_address and self.assignments is not None:
            refusal = await self.assignments.refusal(request.reservation_id, decode_address)
            if refusal is not None:
                logger.warning(
                    "%s: decode address %s not used (%s); the KV goes through the store",
                    request_id, decode_address, refusal,
                )  # fmt: skip
                decode_address = ""
        o, engine, n = self.options, self.engine, len(prompt_ids)
        plan = HandoffPlan(
            request_id,
            n,
            TransportKind.RECOMPUTE,
            decode_address=decode_address,
            decode_host=decode_host,
            decodes=max_tokens > 1 and n + 1 < engine.max_model_len,
            layerwise=o.layerwise,
            timeout_s=o.timeout_s,
        )
        forced = parse_transport(route.transport)
        in_engine = in_engine_kind(engine, forced or parse_transport(o.transport))
        if in_engine is TransportKind.NATIVE:
            return dataclasses.replace(plan, kind=in_engine)
        if in_engine is TransportKind.RECOMPUTE:
            return plan.fall_back("recompute was asked for")
        kind = choose_kind(
            o, self.links, n, n * engine.kv_bytes_per_token, engine.capacity().steps,
            decode_address=decode_address, decode_host=decode_host, forced=forced,
        )  # fmt: skip
        if kind is TransportKind.RECOMPUTE:
            return plan.fall_back(
                "recompute was asked for"
                if forced is not None or o.transport != AUTO
                else "chosen: moving the KV would take longer than computing it again"
            )
        layout = engine.layout
        skip = 0
        if decode_address and o.decode_prefix:
            # Leave out the leading blocks the decode worker caches (decode_prefix).
            skip = await decode_prefix.ask(self.peers, decode_address, layout, prompt_ids, tenant)
        return dataclasses.replace(
            plan,
            kind=kind,
            compression=(
                o.compression
                if kind not in (TransportKind.SHM, TransportKind.NIXL)
                else Compression.NONE
            ),
            prefix_tokens=skip,
            announce=o.announces(
                kind,
                decode_address=decode_address,
                kv_bytes=n * layout.num_layers * layout.bytes_per_token_per_layer,
                max_tokens=max_tokens,
            ),
        )

    @asynccontextmanager
    async def open(self, plan: HandoffPlan) -> AsyncIterator[Outgoing]:
        """``plan``'s hand-off, begun (before the prefill), for an ``async with`` block that
        discards it unless it was handed over; a transport that refuses the hand-off holds
        nothing, and it becomes ``recompute``."""
        sender = None
        if plan.moves:
            sender = self.transports.sender(plan.kind, plan.decode_address)
            rid, n = plan.request_id, plan.num_tokens - plan.prefix_tokens
            try:
                sender.begin(rid, self.engine.layout, n)
            except (CapacityError, KVTransferError) as err:  # shm or nixl full: nothing held
                logger.warning("%s: %s hand-off refused (%s); recompute", rid, plan.kind, err)
                plan, sender = plan.fall_back(f"{plan.kind} refused the hand-off: {err}"), None
        address = plan.decode_address

        async def announce(location: KVLocation) -> str:
            return await self.peers.announce(address, location)

        out = Outgoing(
            plan, sender, fingerprint=self.engine.fingerprint, links=self.links,
            bandwidth=self.bandwidth, announce=announce if plan.announce else None,
        )  # fmt: skip
        try:
            yield out
        finally:
            if not out.handed_over:
                await out.discard()

    async def sweep(self) -> None:
        """Periodic: free the shm slots whose hand-off outlived its lease unread, and the
        NIXL blocks their readers are done with (or whose lease ran out)."""
        if self._shm_slots is not None:
            self._shm_slots.expire()
        if self.nixl is not None:
            self.nixl.sweep()

    async def close(self) -> None:
        """Close the connections to decode workers and the reservation check; stop the
        threads and unlink the reused shm segments."""
        if self.assignments is not None:
            await self.assignments.close()
        self._shm_pool.shutdown(wait=True)
        self._shm_closer.shutdown(wait=True)
        if self._shm_slots is not None:
            self._shm_slots.close()
        self._sealer.shutdown(wait=True)
        if self.nixl is not None:
            self.nixl.close()
        await self.peers.close()
