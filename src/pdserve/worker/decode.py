"""DecodeWorker: continue prefilled requests from their handed-over KV, or run whole requests.

``decode`` (the Decode service), by the handle's location:

* ``store``: stream the layer stream from the KV store with ``delete_after_read``,
  assembling layers as the chunks arrive;
* ``direct``: the prefill worker pushed the stream into this worker (``Decode.Push``), which
  assembled it as it landed (``inbox``); take it in-process (one naming another worker is not
  here: recompute);
* ``shm``: read the segment on this host (the reader unlinks it);
* ``native``: the prefill worker's engine kept the KV; this worker's engine, of the same
  backend, pulls it itself as the decode starts (TensorRT-LLM's generation-only request);
* ``recompute``: nothing was moved; prefill the prompt here. With ``resumed`` tokens (a
  request migrating from a decode worker that died mid-stream) the prompt, the first token
  and those are prefilled together and the request continues after them
  (``worker.migration``).

A ``store`` or ``shm`` hand-off announced by the prefill worker when it began
(``prefetch``, ``worker.prefetch``) is read while the prefill computes; ``decode`` then only
waits for what is left of it.

Every receive is bounded (``--kv-transfer-timeout-s``, or from the payload's size and the
bandwidth measured so far). On a timeout, a broken stream, a bad checksum or a missing entry,
the worker falls back to recompute and the request completes; a payload of another model
(``KVPayloadMismatchError``) and a bad request fail it. Whatever happens, the transport's copy
is freed (read-and-deleted, or discarded). Then the payload is imported with the prefill's
first token and the tokens after it stream out.

Recompute runs the prompt with ``max_tokens=1`` and ``hold_kv``, exports the KV and imports it
as if it had been transferred, so the tokens that follow are exactly those of a transfer (the
prefill's first token is kept; seeded sampling draws by output position). A backend whose KV
cannot leave its engine (``features.kv_payload`` false) recomputes inside its decode instead,
and refuses store, direct and shm hand-offs (``kv.location``).

``generate`` (the Mixed service): prefill and decode in this worker's engine, which
interleaves the prompt's chunks with the running decodes; the stream starts with the first
token.

Closing a stream early (a cancelled RPC) aborts the request: its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncGenerator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass

from pdserve.backends import EngineBackend, Handoff, NativeKV
from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import (
    CapacityError,
    InvalidArgumentError,
    KVPayloadMismatchError,
    KVTransferError,
    UnknownRequestError,
)
from pdserve.handoff.prefetch import PREFETCH_TIMEOUT_S, PREFETCHED, Prefetch, Prefetches
from pdserve.kvstore.client import KVStoreClient
from pdserve.prefix import decode as decode_prefix
from pdserve.security.options import INSECURE, SecurityOptions
from pdserve.timing import RequestTiming
from pdserve.transfer.base import HandoffRecord, KVLocation, KVReceiver, TransportKind
from pdserve.transfer.links import Links
from pdserve.transfer.shm.slots import SlotMappings
from pdserve.transfer.stream.inbox import Inbox
from pdserve.transfer.transports import ReceiveSide, receivers
from pdserve.worker.delta import DecodeDelta, Finished, delta_of
from pdserve.worker.migration import Resumed, resume
from pdserve.worker.prefill import check_request

logger = logging.getLogger(__name__)

FALLBACK_ERRORS = (KVTransferError, UnknownRequestError, CapacityError)
"""Receive failures after which the worker recomputes instead of failing the request."""


@dataclass(frozen=True, slots=True)
class PrefetchOutcome:
    """What ``DecodeWorker.prefetch`` answers (``PrefetchResponse``)."""

    accepted: bool
    ready: bool = False
    reason: str = ""


@dataclass(slots=True)
class _Arrival:
    payload: KVPayload | NativeKV | None
    """None: the backend computes the prompt itself (a recompute it does not export)."""
    record: HandoffRecord
    transfer_ms: float
    recompute_ms: float


class DecodeWorker:
    """Streams decodes (and colocated generations) from one engine backend.

    ``inbox``: the ``direct`` hand-offs prefill workers push into this worker
    (``Decode.Push``). ``transfer_timeout_s``: bound on each receive (0: from
    the payload's size and the bandwidth measured so far). ``security``: TLS and the internal
    token of the calls to KV stores.
    """

    def __init__(
        self,
        engine: EngineBackend,
        *,
        store_timeout_s: float = 10.0,
        inbox: Inbox | None = None,
        host: str | None = None,
        transfer_timeout_s: float = 0.0,
        security: SecurityOptions = INSECURE,
    ) -> None:
        if not transfer_timeout_s >= 0:
            raise InvalidArgumentError(
                "transfer_timeout_s", f"must be >= 0, got {transfer_timeout_s}"
            )
        self.engine = engine
        self.store_timeout_s = store_timeout_s
        self.inbox = inbox
        self.host = host or socket.gethostname()
        self.transfer_timeout_s = transfer_timeout_s
        self.security = security
        self.links = Links(self.host)
        self.fingerprint = engine.fingerprint
        self.prefetches = Prefetches()
        self._stores: dict[str, KVStoreClient] = {}
        # Checks the K half of shm layers beside the reading thread's V half.
        self._hash_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-hash")
        # Prefill workers' reused shm slots, kept mapped between hand-offs (``transfer.shm.slots``).
        self._slot_maps = SlotMappings()
        self.transports = receivers(
            ReceiveSide(
                store=self._store, expected_layout=engine.layout, host=self.host, inbox=inbox,
                hash_pool=self._hash_pool, slot_maps=self._slot_maps,
            )
        )  # fmt: skip
        # Prefill workers ask which prompt prefix this engine caches (Decode.CachedPrefix).
        self._prefix_oracle = decode_prefix.DecodePrefixOracle(engine)

    async def close(self) -> None:
        """Drop the prefetches, close the KV store connections."""
        await self.prefetches.close()
        self._hash_pool.shutdown(wait=True)
        self._slot_maps.close()
        stores, self._stores = self._stores, {}
        for client in stores.values():
            await client.close()

    def _store(self, address: str) -> KVStoreClient:
        client = self._stores.get(address)
        if client is None:
            client = self._stores[address] = KVStoreClient(
                address, timeout_s=self.store_timeout_s, security=self.security
            )
        return client

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

    # -- CachedPrefix ----------------------------------------------------------------------
    async def cached_prefix(self, query: decode_prefix.PrefixQuery) -> int:
        """Leading blocks of ``query`` this worker's engine caches (``prefix.decode``);
        answered on the engine thread, only a hint."""
        return await self._prefix_oracle(query)

    # -- Prefetch --------------------------------------------------------------------------
    async def prefetch(self, kv: KVLocation) -> PrefetchOutcome:
        """Read a hand-off that is still being written, until its last layer has landed (see
        ``worker.prefetch``). Not accepted when this location is not one to prefetch (the
        ``Decode`` call reads it). Cancelling this stops the read and leaves the KV."""
        if kv.kind not in PREFETCHED or kv.model_fingerprint != self.fingerprint:
            return PrefetchOutcome(accepted=False)
        if kv.kind is TransportKind.STORE and not kv.address:
            raise InvalidArgumentError("kv.store.address", "must be the store's host:port")
        receiver = self._receiver(kv, follow=True)  # holds nothing until it receives
        if receiver is None or not self.prefetches.start(kv, receiver, PREFETCH_TIMEOUT_S):
            return PrefetchOutcome(accepted=False)
        try:
            reason = await self.prefetches.wait(kv.request_id)
        except asyncio.CancelledError:
            await self.prefetches.cancel(kv.request_id)
            raise
        return PrefetchOutcome(accepted=True, ready=not reason, reason=reason)

    async def sweep(self) -> None:
        """Drop prefetches that no Decode call took in time, and mappings of dropped shm
        slots."""
        await self.prefetches.sweep()
        self._slot_maps.sweep()  # mappings of slots their writer dropped hold their memory

    # -- Decode ----------------------------------------------------------------------------
    async def decode(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        first_token: tuple[int, float],
        params: SamplingParams,
        kv: KVLocation,
        *,
        tenant: str = "",
        reservation_id: str = "",
        resumed: Sequence[int] = (),
    ) -> AsyncGenerator[DecodeDelta, None]:
        """The tokens after ``first_token`` (and after ``resumed``, the tokens a decode worker
        that died had streamed); the transport's copy is gone when this ends."""
        params = params.without_prompt_logprobs()  # they went out with the prefill's answer
        if resumed:
            check_request(self.engine, request_id, prompt_ids, params)
            deltas = resume(
                self.engine,
                self.fingerprint,
                Resumed(request_id, prompt_ids, [first_token[0], *resumed], params, kv),
                tenant=tenant,
                reservation_id=reservation_id,
            )
            async with aclosing(deltas):
                async for delta in deltas:
                    yield delta
            return
        started = time.perf_counter()
        prefetch = await self.prefetches.take(kv)
        receiver = prefetch.receiver if prefetch is not None else self._receiver(kv)
        try:
            check_request(self.engine, request_id, prompt_ids, params)
            # A recompute handle moves no KV: one without a fingerprint (a migrated colocated
            # request) has nothing to mismatch.
            unnamed = kv.kind is TransportKind.RECOMPUTE and not kv.model_fingerprint
            if kv.model_fingerprint != self.fingerprint and not unnamed:
                raise KVPayloadMismatchError(
                    f"KV handle fingerprint {kv.model_fingerprint!r} differs from this "
                    f"worker's {self.fingerprint!r}"
                )
            if kv.prefix_tokens + kv.num_tokens != len(prompt_ids):
                raise InvalidArgumentError(
                    "kv.num_tokens",
                    f"{kv.prefix_tokens} + {kv.num_tokens}, but the prompt has "
                    f"{len(prompt_ids)} tokens",
                )
            arrival = await self._arrive(
                request_id, prompt_ids, params, kv, receiver, tenant, reservation_id, prefetch
            )
        finally:
            if receiver is not None:
                await receiver.discard()  # a no-op once a read consumed it

        timing = RequestTiming()
        stream = self.engine.decode(
            request_id,
            prompt_ids,
            params,
            first_token,
            arrival.payload,
            cache_salt=tenant,
            tag=reservation_id,
            timing=timing,
            coalesce=True,  # a stream that fell behind catches up in one chunk
        )
        async with aclosing(stream):
            async for out in stream:
                final = None
                if out.finished:
                    figures = timing.decode(
                        started=started,
                        recompute_ms=arrival.recompute_ms,
                        transfer_ms=arrival.transfer_ms,
                        transfer_bytes=arrival.record.num_bytes,
                        transport=arrival.record.transport,
                    )
                    final = Finished(figures, timing, arrival.record)
                yield delta_of(out, final, num_cached_tokens=0)

    async def _arrive(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        kv: KVLocation,
        receiver: KVReceiver | None,
        tenant: str,
        reservation_id: str,
        prefetch: Prefetch | None = None,
    ) -> _Arrival:
        """The KV: received (or its prefetch waited for), or recomputed when nothing was sent
        or the receive failed."""
        if kv.kind is TransportKind.NATIVE:  # the engine pulls the KV as the decode starts
            if kv.native is None:
                raise InvalidArgumentError("kv.native", "a native location needs its handle")
            return _Arrival(kv.native, HandoffRecord(TransportKind.NATIVE.value), 0.0, 0.0)
        reason = kv.reason or "nothing was sent"
        transfer_ms = 0.0
        if receiver is not None:
            peer = kv.host or kv.address
            timeout = self.links.timeout_s(peer, kv.kind, kv.num_bytes, self.transfer_timeout_s)
            start = time.perf_counter()
            try:
                if prefetch is not None:  # only its tail is left: the transfer's own bound
                    payload = await asyncio.wait_for(prefetch.task, timeout)
                else:
                    payload = await receiver.receive(timeout)
                if kv.prefix_tokens:  # the rest of the prompt; its prefix is in our cache
                    payload = await decode_prefix.join_cached_prefix(
                        self.engine, payload, prompt_ids, kv.prefix_tokens, tenant
                    )
            except FALLBACK_ERRORS as err:
                transfer_ms = (time.perf_counter() - start) * 1000.0
                reason = f"{kv.kind} receive failed: {err}"
                logger.warning("%s: %s; recomputing", request_id, reason)
            else:
                waited = (time.perf_counter() - start) * 1000.0
                record = receiver.record.received(
                    compression=receiver.compression,
                    wait_ms=waited if prefetch is not None else None,
                )
                if prefetch is None:  # a prefetch's read is paced by the prefill, not the link
                    self.links.observe(peer, record)
                return _Arrival(payload, record, waited, 0.0)
        record = HandoffRecord(TransportKind.RECOMPUTE.value, fallback_reason=reason)
        if not self.engine.features.kv_payload:  # the backend recomputes as it decodes
            return _Arrival(None, record, transfer_ms, 0.0)
        start = time.perf_counter()
        payload = await self._recompute(request_id, prompt_ids, params, tenant, reservation_id)
        return _Arrival(payload, record, transfer_ms, (time.perf_counter() - start) * 1000.0)

    async def _recompute(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        tenant: str,
        reservation_id: str,
    ) -> KVPayload:
        """Prefill the prompt here and take its KV, as a transfer would have delivered it."""
        held = False
        try:
            await self.engine.prefill(
                request_id,
                prompt_ids,
                params,
                handoff=Handoff.HOLD,
                cache_salt=tenant,
                tag=reservation_id,
            )
            held = True
            payload = await self.engine.export_kv(request_id)
            held = False
            return payload
        finally:
            if held:
                self.engine.abort(request_id)  # releases the held blocks

    # -- Mixed -----------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        tenant: str = "",
        reservation_id: str = "",
    ) -> AsyncGenerator[DecodeDelta, None]:
        """Prefill and decode here; the first delta carries the first token."""
        check_request(self.engine, request_id, prompt_ids, params)
        timing = RequestTiming()
        stream = self.engine.generate(
            request_id, prompt_ids, params, cache_salt=tenant, tag=reservation_id, timing=timing
        )
        async with aclosing(stream):
            async for out in stream:
                final = None
                if out.finished:
                    final = Finished(timing.generate(), timing)
                yield delta_of(
                    out, final, num_cached_tokens=out.num_cached_tokens if out.finished else 0
                )
