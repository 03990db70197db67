"""The prefill side of a prefetch: tell the decode worker of a hand-off as it begins.

``Announced`` wraps a layer-wise ``store`` or ``shm`` ``KVSender``: right after ``begin`` it
calls ``Decode.Prefetch`` on the chosen decode worker with the location being written (a
tracked task, beside the prefill's compute), so that the decode worker reads the layers as
they land (``worker.prefetch``). That call answers once the decode worker holds the checked
KV; ``commit`` waits for the answer (bounded by the commit's own timeout, then cancelled)
before it returns the location, so when the prefill answers, the ``Decode`` call finds the
KV ready. A decode worker that declines, fails or is late changes nothing: its ``Decode``
call reads the KV as it always did.

``decode_stubs.DecodeStubs`` makes the ``Announce`` functions, one channel per address.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import torch
from grpc.aio import AioRpcError

from pdserve.engine.kv_payload import KVLayout
from pdserve.transfer.base import HandoffRecord, KVLocation, KVSender, TransferState, TransportKind

logger = logging.getLogger(__name__)

Announce = Callable[[KVLocation], Coroutine[Any, Any, str]]
"""Sends one announcement and waits for the decode worker's read: "" once it holds the
checked KV, else why not."""


class Announcers(Protocol):
    """Makes the ``Announce`` of a decode worker address (``decode_stubs.DecodeStubs``)."""

    def announcer(self, address: str) -> Announce: ...

    async def close(self) -> None: ...


class Announced:
    """A ``KVSender`` whose hand-off is announced to the decode worker at ``begin``."""

    def __init__(self, inner: KVSender, announce: Announce, fingerprint: str) -> None:
        self.inner = inner
        self.announce = announce
        self.fingerprint = fingerprint
        self.outcome = "not announced"
        """"" once the decode worker held the checked KV, else why not (after ``commit``)."""
        self._task: asyncio.Task[str] | None = None

    @property
    def kind(self) -> TransportKind:
        return self.inner.kind

    @property
    def state(self) -> TransferState:
        return self.inner.state

    @property
    def record(self) -> HandoffRecord:
        return self.inner.record

    @property
    def busy_ns(self) -> int:
        return self.inner.busy_ns

    def begin(self, request_id: str, layout: KVLayout, num_tokens: int) -> None:
        self.inner.begin(request_id, layout, num_tokens)
        location = dataclasses.replace(self.inner.planned(), model_fingerprint=self.fingerprint)
        self._task = asyncio.get_running_loop().create_task(
            self.announce(location), name=f"kv-announce-{request_id}"
        )

    def planned(self) -> KVLocation:
        return self.inner.planned()

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.send_layer(layer, k, v)

    async def commit(self, timeout_s: float) -> KVLocation:
        location = await self.inner.commit(timeout_s)
        task, self._task = self._task, None
        if task is not None:
            try:
                self.outcome = await asyncio.wait_for(task, timeout_s)  # cancels it if late
            except TimeoutError:
                self.outcome = f"no answer within {timeout_s:.3g} s"
            except AioRpcError as err:  # an old or failing decode worker
                self.outcome = f"{err.code().name}: {err.details()}"
            if self.outcome:  # the Decode call reads the KV the usual way
                logger.info("%s: prefetch: %s", location.request_id, self.outcome)
            # The hand-off ends when the decode worker holds the KV: the wait for its read's
            # tail is transfer time the first token waits for (``exposed_ms``).
            self.record.send_end_ns = time.monotonic_ns()
        return location

    async def discard(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Discarding: the announcement's outcome no longer matters.
            with contextlib.suppress(asyncio.CancelledError, AioRpcError):
                await task
        await self.inner.discard()
