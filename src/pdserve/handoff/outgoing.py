"""``Outgoing``: one hand-off on the prefill side, carried out as its ``HandoffPlan`` says.

Made by ``PrefillConnector.open`` once the plan's sender has begun (the shm segment or the
stream exists before the engine starts). Then:

1. Hook (engine thread): ``layer_hook`` takes each layer's K and V; only the tokens after the
   plan's ``prefix_tokens`` (the decode worker caches the rest) go on. Layer-wise, each layer
   goes straight to the sender while the engine computes the next ones; otherwise (the
   no-overlap baseline) it is kept, and sent at the commit.
2. Announce: a plan that says so tells the decode worker at once (``Decode.Prefetch``, a task
   beside the compute), so that it reads the layers as they land (``handoff.prefetch``).
3. Hand over: ``hand_over`` commits, bounded by the plan's timeout or one from the link's
   measured bandwidth (``Links.timeout_s``), waits (within the same bound) for the
   announcement's answer, and returns where the KV is with the sender's record (the link
   learns from it). A commit that fails (store down or full, a stream cut off, a timeout) is
   discarded and answered ``recompute``: the decode worker prefills the prompt itself.
4. Discard: on every path that does not hand the KV over (a request that ends at its first
   token, a failure, a cancellation), leaving the ``async with`` block frees what the sender
   holds and cancels the announcement.

``recompute`` and ``native`` plans have no sender: nothing moves through pdserve, and the
answer is the recompute handle or the engine's own (``NativeKV``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpc.aio import AioRpcError

from pdserve.backends import Handoff, NativeKV
from pdserve.engine.kv_arrays import host_copy
from pdserve.engine.sequence import LayerHook
from pdserve.errors import KVTransferError, PdServeError
from pdserve.handoff.plan import HandoffPlan
from pdserve.transfer.bandwidth import BandwidthMeter
from pdserve.transfer.base import HandoffRecord, KVLocation, KVSender, TransportKind
from pdserve.transfer.links import Links

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

logger = logging.getLogger(__name__)

Announce = Callable[[KVLocation], Coroutine[Any, Any, str]]
"""Sends one announcement and waits for the decode worker's read: "" once it holds the
checked KV, else why not."""


@dataclass(frozen=True, slots=True)
class Sent:
    """Where the KV is, and the sender's record of the hand-off."""

    location: KVLocation
    record: HandoffRecord

    @property
    def num_bytes(self) -> int:
        """Bytes handed over (0 when nothing moved, or the hand-off fell back)."""
        return 0 if self.location.kind is TransportKind.RECOMPUTE else self.record.num_bytes


class Outgoing:
    """One hand-off's prefill side (module docstring), in ``PrefillConnector.open``'s block."""

    def __init__(
        self,
        plan: HandoffPlan,
        sender: KVSender | None,
        *,
        fingerprint: str,
        links: Links,
        bandwidth: BandwidthMeter | None = None,
        announce: Announce | None = None,
    ) -> None:
        """``sender``: begun, for a plan that moves the KV; ``bandwidth``: where its bytes are
        metered (None: nowhere); ``announce``: how to tell the decode worker (a plan that
        announces)."""
        self.plan = plan
        self.sender = sender
        self.fingerprint = fingerprint
        self.links = links
        self.bandwidth = bandwidth
        self._kept: list[tuple[int, KVArray, KVArray]] = []
        self.handed_over = False
        """The KV is the decode side's now (else leaving the block discards it)."""
        self._announcement: asyncio.Task[str] | None = None
        if sender is not None and announce is not None and plan.announce:
            self._announcement = asyncio.get_running_loop().create_task(
                announce(self.planned()), name=f"kv-announce-{plan.request_id}"
            )

    @property
    def engine_handoff(self) -> Handoff:
        """What the engine does with the prompt's KV once the first token is out: keep it
        for its own transfer (``native``, when a Decode call follows), else free it."""
        native = self.plan.kind is TransportKind.NATIVE and self.plan.decodes
        return Handoff.NATIVE if native else Handoff.RELEASE

    @property
    def layer_hook(self) -> LayerHook | None:
        """The prefill's layer hook (never raises); None when nothing moves."""
        if self.sender is None:
            return None
        return self._send if self.plan.layerwise else self._keep

    def _send(self, layer: int, keys: KVArray, values: KVArray) -> None:
        if (p := self.plan.prefix_tokens) > 0:
            keys, values = keys[p:], values[p:]  # views; the transport makes its one copy
        assert self.sender is not None  # only hooked with a sender
        self.sender.send_layer(layer, keys, values)

    def _keep(self, layer: int, keys: KVArray, values: KVArray) -> None:
        # Keeping them is the engine's export, done layer by layer (the views die after this).
        p = self.plan.prefix_tokens
        self._kept.append((layer, host_copy(keys[p:]), host_copy(values[p:])))

    def planned(self) -> KVLocation:
        """Where the KV is going (what ``hand_over`` returns when it commits)."""
        if self.sender is None:
            raise KVTransferError(f"a {self.plan.kind} hand-off moves nothing")
        return dataclasses.replace(
            self.sender.planned(),
            model_fingerprint=self.fingerprint,
            prefix_tokens=self.plan.prefix_tokens,
        )

    async def hand_over(self, compute_end_ns: int, native: NativeKV | None = None) -> Sent:
        """Commit (or say ``recompute``, with the reason, when that fails); ``native``: the
        engine's handle of the KV it kept (a ``native`` plan)."""
        plan, out = self.plan, self.sender
        rid, n = plan.request_id, plan.num_tokens
        if plan.kind is TransportKind.NATIVE:
            if native is None:
                raise KVTransferError(f"the engine kept no KV for {rid!r}")
            self.handed_over = True
            location = KVLocation.of_native(rid, n, self.fingerprint, native)
            return Sent(location, HandoffRecord(TransportKind.NATIVE.value))
        if out is None:
            location = KVLocation.recompute(rid, n, self.fingerprint, plan.reason)
            record = HandoffRecord(TransportKind.RECOMPUTE.value, fallback_reason=plan.reason)
            return Sent(location, record)
        timeout = self.links.timeout_s(plan.peer, plan.kind, out.record.num_bytes, plan.timeout_s)
        try:
            kept, self._kept = self._kept, []
            for layer, k, v in kept:
                out.send_layer(layer, k, v)
            location = await out.commit(timeout)
            await self._announced(timeout)
        except PdServeError as err:
            # Store down or full, a stream cut off, a timeout: the decode worker recomputes.
            logger.warning("%s: %s hand-off failed (%s); recompute", rid, plan.kind, err)
            await self.discard()
            # The capability of the hand-off that fell back: a decode worker that began to
            # read it early (a prefetch) may drop that read at once (``prefetch.take``).
            capability = out.planned().capability
            location = KVLocation.recompute(rid, n, self.fingerprint, str(err), capability)
            return Sent(location, self._record(compute_end_ns, fallback_reason=str(err)))
        record = self._record(compute_end_ns)
        # nixl: nothing crossed the link yet (the decode worker READs it, and measures that).
        if plan.kind is not TransportKind.NIXL:
            self.links.observe(plan.peer, record)
            if self.bandwidth is not None:
                self.bandwidth.record_handoff(plan.peer, record)
        self.handed_over = True
        location = dataclasses.replace(
            location, model_fingerprint=self.fingerprint, prefix_tokens=plan.prefix_tokens
        )
        return Sent(location, record)

    def _record(self, compute_end_ns: int, **changes: object) -> HandoffRecord:
        assert self.sender is not None
        return self.sender.record.replace(
            compute_end_ns=compute_end_ns,
            busy_ns=self.sender.busy_ns,
            compression=self.plan.compression.value,
            layerwise=self.plan.layerwise,
            **changes,
        )

    async def _announced(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``, then cancel it) for the announcement's answer: when
        the prefill answers, the decode worker holds the checked KV."""
        task, self._announcement = self._announcement, None
        if task is None or self.sender is None:
            return
        try:
            outcome = await asyncio.wait_for(task, timeout_s)
        except TimeoutError:
            outcome = f"no answer within {timeout_s:.3g} s"
        except AioRpcError as err:  # an old or failing decode worker
            outcome = f"{err.code().name}: {err.details()}"
        if outcome:  # the Decode call reads the KV the usual way
            logger.info("%s: prefetch: %s", self.plan.request_id, outcome)
        # The hand-off ends when the decode worker holds the KV: the wait for its read's
        # tail is transfer time the first token waits for (``exposed_ms``).
        self.sender.record.send_end_ns = time.monotonic_ns()

    async def discard(self) -> None:
        """Free what the hand-off holds and cancel its announcement (idempotent); after a
        commit, revoke it."""
        self._kept = []
        task, self._announcement = self._announcement, None
        if task is not None:
            task.cancel()
            # Discarding: the announcement's outcome no longer matters.
            with contextlib.suppress(asyncio.CancelledError, AioRpcError):
                await task
        if self.sender is not None:
            await self.sender.discard()
