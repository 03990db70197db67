"""What the event loop sends to ``AsyncEngine``'s engine thread, and how outputs come back.

The engine thread takes ``Command``s from a thread-safe queue; each request's outputs go back
to its ``RequestStream`` (an ``asyncio.Queue`` on the consumer's loop), one wake-up of that loop
per engine step (``post_outputs``, ``deliver``); ``fail_queued`` answers what is left at shutdown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.engine import Engine
from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import EngineRequest
from pdserve.engine.sequence import LayerHook
from pdserve.timing import RequestTiming

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class RequestStream:
    """The event-loop side of one request: where its outputs go."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    timing: RequestTiming
    reservation_id: str
    hold_kv: bool

    def post(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is left to tell
            logger.warning("dropping output of %s: its event loop is closed", self.request_id)


@dataclass(slots=True)
class AddCommand:
    """Admit a request (see ``AsyncEngine.generate``)."""

    stream: RequestStream
    request: EngineRequest
    kv: KVPayload | None
    first_token: tuple[int, float] | None
    layer_hook: LayerHook | None
    generated: Sequence[int] = ()
    """Output tokens drawn elsewhere before a migration (``Engine.add_request``)."""


@dataclass(slots=True)
class AbortCommand:
    """Abort a request and free its blocks."""

    request_id: str
    stream: RequestStream | None
    """Abort only if this stream is still the request's (a failed duplicate must not abort
    the request it collided with); None aborts whatever runs under the id."""


@dataclass(slots=True)
class HandBackCommand:
    """End every running stream with ``HandedBackError(why)`` and free its blocks;
    held KV (a prefill waiting for export) stays (``AsyncEngine.hand_back``)."""

    why: str


@dataclass(slots=True)
class CallCommand:
    """Run ``fn`` on the engine thread; its result or exception resolves ``future``."""

    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future[Any]


class StopCommand:
    """Ends the engine thread's loop."""


def deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """On the consumers' event loop: hand one step's outputs to their requests' queues."""
    for stream, out in items:
        stream.queue.put_nowait(out)


Deliveries = dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]]
"""A step's outputs grouped by the event loop of their consumers."""


def post_outputs(deliveries: Deliveries) -> None:
    """On the engine thread: one ``deliver`` per event loop for a step's outputs (each
    wake-up costs the engine thread a GIL hand-over to that loop)."""
    for loop, items in deliveries.items():
        try:
            loop.call_soon_threadsafe(deliver, items)
        except RuntimeError:  # the consumers' loop is closed: nobody is left to tell
            n = len(items)
            logger.warning("dropping outputs of %d requests: their event loop is closed", n)


Command = AddCommand | AbortCommand | HandBackCommand | CallCommand | StopCommand


def fail_queued(commands: queue.SimpleQueue[Command], error: Exception) -> None:
    """On the engine thread, once it stopped: fail the requests and calls still queued with
    ``error`` (aborts and stops have nobody waiting)."""
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            return
        if isinstance(command, AddCommand):
            command.stream.post(error)
        elif isinstance(command, CallCommand) and command.future.set_running_or_notify_cancel():
            command.future.set_exception(error)
