"""PrefillWorker: compute a prompt's KV and first token, and hand the KV over as it is made.

Per request:
  1. Check the request against the model (the full ``max_tokens`` included, so that a request
     the decode side would refuse fails here, before any compute), and the decode worker it
     names against its reservation (``assignment.AssignedDecode``): an address the scheduler
     did not assign is not used (the KV then goes through the KV store).
  2. Choose the transport (``placement.TransportChooser``: forced, or shm on the decode
     worker's host, else direct/store, or recompute) and ``begin`` it: the shm segment or the
     Put stream exists before the engine starts. Before that, ask the decode worker which
     leading blocks of the prompt it caches; they are left out (``decode_prefix``).
  3. Optionally import the prompt's leading blocks from the KV store into the engine's prefix
     cache (``prefix.PrefixReuse``), so that only the rest is computed.
  4. Run the prompt with ``max_tokens=1`` and the transport's ``send_layer`` as the layer hook:
     each layer leaves while the engine computes the next ones. The hook copies the layers
     out, so the engine frees the request's blocks as soon as the first token is out.
  5. If that token already ends the request (a stop token or string, ``max_tokens == 1``, the
     model's length), discard the hand-off and report the finish.
  6. Otherwise ``commit`` (bounded) and answer with its location. If the commit fails (store
     down or full, timeout) the hand-off is discarded and the answer says ``recompute``: the
     decode worker then prefills the prompt itself, and the request still completes.

Nothing outlives a request: every path that does not hand the KV over discards it.

On a backend whose KV cannot leave its engine as bytes (TensorRT-LLM), steps 2-6 are the
engine's own: it keeps the KV for its transfer and the answer carries its handle
(``engine_handoff``).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pdserve.backends import EngineBackend, Handoff
from pdserve.convert import check_sampling_against, check_token_ids
from pdserve.engine.outputs import FinishReason, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import CapacityError, InvalidArgumentError, KVTransferError, PdServeError
from pdserve.kvstore.client import KVStoreClient
from pdserve.logprobs import PromptLogprobs, TopLogprobs
from pdserve.prefix import decode as decode_prefix
from pdserve.prefix.decode_client import DecodePrefixClients
from pdserve.prefix.store import PrefixReuse
from pdserve.timing import RequestTiming, Timing
from pdserve.transfer.base import HandoffRecord, KVLocation, KVSender, TransportKind
from pdserve.transfer.links import Links
from pdserve.transfer.shm.slots import SlotPool, slot_budget
from pdserve.transfer.stream.push import PushClient
from pdserve.transfer.transports import SendSide, senders
from pdserve.transfer.wrappers import Deferred, Suffix
from pdserve.worker.announce import Announced, Announcers
from pdserve.worker.assignment import AssignedDecode
from pdserve.worker.engine_handoff import finish_at_first, in_engine_kind, prefill_in_engine
from pdserve.worker.placement import TransferOptions, TransportChooser, parse_transport

logger = logging.getLogger(__name__)


def check_request(
    engine: EngineBackend, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
) -> None:
    """Raise ``InvalidArgumentError`` naming the (proto) field the engine would refuse."""
    if not request_id:
        raise InvalidArgumentError("request_id", "must not be empty")
    check_token_ids(prompt_ids, vocab_size=engine.vocab_size, field="prompt_token_ids")
    if len(prompt_ids) >= engine.max_model_len:
        raise InvalidArgumentError(
            "prompt_token_ids",
            f"{len(prompt_ids)} tokens; the model's maximum length is {engine.max_model_len}",
        )
    check_sampling_against(
        params,
        vocab_size=engine.vocab_size,
        max_model_len=engine.max_model_len,
        prompt_len=len(prompt_ids),
    )


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """The first token, where its KV went, and where the time went."""

    first_token_id: int
    first_logprob: float
    kv: KVLocation | None
    """None when ``finish_reason`` is set (nothing left to decode)."""
    finish_reason: FinishReason | None
    timing: Timing
    """The figures (``RequestTiming.prefill``): queue, compute (``prefill_ms``), the part of
    the hand-off not hidden behind the compute (end of compute to commit), bytes sent."""
    num_cached_tokens: int
    transfer: HandoffRecord | None = None
    """The sender's measurements; None when nothing was sent."""
    stamps: RequestTiming | None = None
    """The engine-thread stamps the figures were derived from (the stage spans)."""
    first_top_logprobs: TopLogprobs | None = None
    """The first token's alternatives (``SamplingParams.logprobs`` > 0)."""
    prompt_logprobs: PromptLogprobs | None = None
    """``SamplingParams.prompt_logprobs`` set: the prompt's logprobs."""


@dataclass(slots=True)
class _Sent:
    location: KVLocation
    record: HandoffRecord | None


class PrefillWorker:
    """Runs prefills on one engine backend and hands their KV over (see the module docstring)."""

    def __init__(
        self,
        engine: EngineBackend,
        store: KVStoreClient,
        *,
        lease_s: float = 60.0,
        host: str | None = None,
        options: TransferOptions | None = None,
        prefix: PrefixReuse | None = None,
        announcers: Announcers | None = None,
        assignments: AssignedDecode | None = None,
        links: Links | None = None,
    ) -> None:
        """``announcers``: tell decode workers of layer-wise store/shm hand-offs as they
        begin (``worker.announce``); None: they read them at the Decode call.
        ``assignments``: use a decode address only if the request's reservation holds it
        (``worker.assignment``); None (no scheduler): any address is used. ``links``: what
        this host knows of its KV links (a sim worker's modelled ones; default: measured)."""
        if not lease_s > 0:
            raise InvalidArgumentError("lease_s", f"must be > 0, got {lease_s}")
        self.engine = engine
        self.store = store
        self.host = host or socket.gethostname()
        self.options = options or TransferOptions(lease_s=lease_s)
        links = links or Links(self.host)
        self.chooser = TransportChooser(links, engine.kv_bytes_per_token, self.options)
        self.prefix = prefix
        self.fingerprint = engine.fingerprint
        # Decode workers' cached-prefix answers (decode_prefix), with the store's deadline.
        self._prefix_queries = DecodePrefixClients(
            timeout_s=store.timeout_s, security=store.security
        )
        self._pushes: dict[str, PushClient] = {}  # decode workers' Decode.Push (direct)
        self.announcers = announcers
        self.assignments = assignments
        # shm: one thread copies each layer's K beside the engine thread's V; another unmaps
        # sealed segments off the request's path.
        self._shm_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shm-copy")
        self._shm_closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shm-unmap")
        # shm segments kept mapped and reused: neither side builds page tables per hand-off.
        budget = slot_budget(self.options.shm_slot_bytes)
        self._shm_slots = SlotPool(budget, lease_s=self.options.lease_s) if budget else None
        # store/direct: one thread seals the large frames of every stream, in the order taken.
        self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-seal")
        o = self.options
        self.transports = senders(
            SendSide(
                store=store, endpoint=self._push, host=self.host, lease_s=o.lease_s,
                compression=o.compression, sealer=self._sealer, shm_pool=self._shm_pool,
                shm_closer=self._shm_closer, shm_slots=self._shm_slots, faults=o.faults,
            )
        )  # fmt: skip

    async def sweep(self) -> None:
        """Periodic: free the shm slots whose hand-off outlived its lease unread."""
        if self._shm_slots is not None:
            self._shm_slots.expire()

    async def close(self) -> None:
        """Close the connections to decode workers' endpoints, wait for prefix publishing."""
        if self.prefix is not None:
            await self.prefix.close()
        if self.announcers is not None:
            await self.announcers.close()
        if self.assignments is not None:
            await self.assignments.close()
        self._shm_pool.shutdown(wait=True)
        self._shm_closer.shutdown(wait=True)
        if self._shm_slots is not None:
            self._shm_slots.close()
        self._sealer.shutdown(wait=True)
        await self._prefix_queries.close()
        pushes, self._pushes = self._pushes, {}
        for push in pushes.values():
            await push.close()

    def _push(self, address: str) -> PushClient:
        client = self._pushes.get(address)
        if client is None:
            client = self._pushes[address] = PushClient(
                address, timeout_s=self.store.timeout_s, security=self.store.security
            )
        return client

    def _sender(
        self, kind: TransportKind, decode_address: str, *, announce: bool = False
    ) -> KVSender | None:
        """The hand-off's sender; ``announce``: tell the decode worker as it begins
        (``TransferOptions.announces``)."""
        if kind is TransportKind.RECOMPUTE:
            return None
        o = self.options
        out = self.transports.sender(kind, decode_address)
        if not o.layerwise:
            return Deferred(out)
        if announce and self.announcers is not None:
            return Announced(out, self.announcers.announcer(decode_address), self.fingerprint)
        return out

    async def prefill(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        tenant: str = "",
        reservation_id: str = "",
        decode_address: str = "",
        decode_host: str = "",
        transport: str = "",
    ) -> PrefillResult:
        check_request(self.engine, request_id, prompt_ids, params)
        if decode_address and self.assignments is not None:
            refusal = await self.assignments.refusal(reservation_id, decode_address)
            if refusal is not None:
                logger.warning(
                    "%s: decode address %s not used (%s); the KV goes through the store",
                    request_id, decode_address, refusal,
                )  # fmt: skip
                decode_address = ""
        forced = parse_transport(transport)
        in_engine = in_engine_kind(self.engine, forced or parse_transport(self.options.transport))
        if in_engine is not None:
            return await self._prefill_in_engine(
                request_id, prompt_ids, params, in_engine, tenant, reservation_id
            )
        kind = self.chooser.choose(
            len(prompt_ids),
            self.engine.capacity().steps,
            decode_address=decode_address,
            decode_host=decode_host,
            forced=forced,
        )
        layout = self.engine.layout
        announce = self.options.announces(
            kind,
            decode_address=decode_address,
            kv_bytes=len(prompt_ids) * layout.num_layers * layout.bytes_per_token_per_layer,
            max_tokens=params.max_tokens,
        )
        out = self._sender(kind, decode_address, announce=announce)
        if out is not None and decode_address and self.options.decode_prefix:
            # Leave out the leading blocks the decode worker caches (decode_prefix).
            skip = await decode_prefix.ask(
                self._prefix_queries, decode_address, self.engine.layout, prompt_ids, tenant
            )
            out = Suffix(out, skip) if skip else out
        fallback = ""
        if out is None:
            fallback = (
                "recompute was asked for"
                if forced is not None or self.options.transport != "auto"
                else "chosen: moving the KV would take longer than computing it again"
            )
        if out is not None:
            try:
                out.begin(request_id, self.engine.layout, len(prompt_ids))
            except (CapacityError, KVTransferError) as err:  # shm full, ...: nothing was held
                logger.warning("%s: %s hand-off refused (%s); recompute", request_id, kind, err)
                out, fallback = None, f"{kind} refused the hand-off: {err}"
        committed = False
        try:
            timing = RequestTiming()
            last, compute_end_ns = await self._run(
                request_id, prompt_ids, params, tenant, reservation_id, timing, out
            )
            token, logprob = last.new_token_ids[0], last.new_logprobs[0]
            reason = self._finish_reason(last, params, len(prompt_ids))
            sent: _Sent | None = None
            if reason is None:
                peer = decode_host or decode_address
                sent = await self._hand_over(
                    request_id, prompt_ids, out, fallback, compute_end_ns, peer
                )
                committed = sent.location.kind is not TransportKind.RECOMPUTE
            record = sent.record if sent is not None else None
            return PrefillResult(
                first_token_id=token,
                first_logprob=logprob,
                kv=sent.location if sent is not None else None,
                finish_reason=reason,
                timing=timing.prefill(
                    transfer_ms=record.exposed_ms if record else 0.0,
                    transfer_bytes=record.num_bytes if committed and record else 0,
                ),
                num_cached_tokens=last.num_cached_tokens,
                transfer=record,
                stamps=timing,
                first_top_logprobs=next(iter(last.new_top_logprobs), None),
                prompt_logprobs=last.prompt_logprobs,
            )
        finally:
            if out is not None and not committed:
                await out.discard()

    async def _run(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        tenant: str,
        reservation_id: str,
        timing: RequestTiming,
        out: KVSender | None,
    ) -> tuple[RequestOutput, int]:
        """Prefill with the hook; the last output and when the compute ended."""
        publisher = None
        if self.prefix is not None:
            found = await self.prefix.seed(self.engine, request_id, prompt_ids, tenant)
            publisher = self.prefix.publisher(prompt_ids, tenant, first=found)
        hooks = [h for h in (out.send_layer if out else None, publisher) if h is not None]

        def hook(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            for h in hooks:  # each one never raises
                h(layer, keys, values)

        done = await self.engine.prefill(
            request_id,
            prompt_ids,
            params,
            handoff=Handoff.RELEASE,
            cache_salt=tenant,
            tag=reservation_id,
            timing=timing,
            layer_hook=hook if hooks else None,
        )
        last = done.output
        compute_end_ns = time.monotonic_ns()
        if not last.new_token_ids:
            raise KVTransferError(f"prefill of {request_id!r} produced no first token")
        if publisher is not None and self.prefix is not None:
            self.prefix.publish(publisher)
        return last, compute_end_ns

    async def _hand_over(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        out: KVSender | None,
        fallback: str,
        compute_end_ns: int,
        peer: str,
    ) -> _Sent:
        """Commit the hand-off, or say ``recompute`` (with the reason) when it fails.

        ``peer``: the decode worker's host (or address), the link whose bandwidth is measured.
        """
        n = len(prompt_ids)
        if out is None:
            location = KVLocation.recompute(request_id, n, self.fingerprint, fallback)
            record = HandoffRecord(TransportKind.RECOMPUTE.value, fallback_reason=fallback)
            return _Sent(location, record)
        timeout = self.chooser.links.timeout_s(
            peer, out.kind, out.record.num_bytes, self.options.timeout_s
        )
        compression = (
            self.options.compression.value if out.kind is not TransportKind.SHM else "none"
        )
        try:
            location = await out.commit(timeout)
        except PdServeError as err:
            # Store down or full, a stream cut off, a timeout: the decode worker recomputes.
            logger.warning("%s: %s hand-off failed (%s); recompute", request_id, out.kind, err)
            await out.discard()
            record = out.record.replace(
                compute_end_ns=compute_end_ns,
                busy_ns=out.busy_ns,
                compression=compression,
                layerwise=self.options.layerwise,
                fallback_reason=str(err),
            )
            # The capability of the hand-off that fell back: a decode worker that began to
            # read it early (a prefetch) may drop that read at once (``prefetch.take``).
            location = KVLocation.recompute(
                request_id, n, self.fingerprint, str(err), out.planned().capability
            )
            return _Sent(location, record)
        record = out.record.replace(
            compute_end_ns=compute_end_ns,
            busy_ns=out.busy_ns,
            compression=compression,
            layerwise=self.options.layerwise,
        )
        self.chooser.links.observe(peer, record)
        location = dataclasses.replace(location, model_fingerprint=self.fingerprint)
        return _Sent(location, record)

    async def _prefill_in_engine(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        kind: TransportKind,
        tenant: str,
        reservation_id: str,
    ) -> PrefillResult:
        done = await prefill_in_engine(
            self.engine, request_id, prompt_ids, params, kind,
            tenant=tenant, reservation_id=reservation_id,
        )  # fmt: skip
        out = done.output
        return PrefillResult(
            first_token_id=out.new_token_ids[0],
            first_logprob=out.new_logprobs[0],
            kv=done.location,
            finish_reason=done.finish_reason,
            timing=done.timing.prefill(),
            num_cached_tokens=out.num_cached_tokens,
            transfer=done.record,
            stamps=done.timing,
            first_top_logprobs=next(iter(out.new_top_logprobs), None),
            prompt_logprobs=out.prompt_logprobs,
        )

    def _finish_reason(
        self, out: RequestOutput, params: SamplingParams, prompt_len: int
    ) -> FinishReason | None:
        """Whether the first token ends the request under its real ``max_tokens``."""
        return finish_at_first(out, params, prompt_len, self.engine.max_model_len)
