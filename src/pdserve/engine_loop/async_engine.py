"""AsyncEngine: one ``Engine`` on its own thread, driven from an asyncio event loop.

The engine is not thread-safe, so exactly one thread (``engine-loop``) touches it. The event
loop talks to that thread through a thread-safe command queue (add, abort, call) and gets each
request's outputs back on a per-request ``asyncio.Queue`` fed with ``call_soon_threadsafe``.

The engine thread's loop:

1. If the engine has no work, block on the command queue (no polling, no sleeping).
2. Prefill batching: when a request arrives at an idle engine and ``batch_window_ms > 0``, keep
   taking commands for up to that window, or until the step's token budget
   (``max_num_batched_tokens``) or ``max_num_seqs`` fills (``batch_window.BatchWindow``;
   with ``adaptive_window``, the default, only once requests have been seen arriving
   together). While the engine is busy, new requests simply join the next step (continuous
   batching), so the window costs nothing under load.
3. Apply every queued command, run one ``Engine.step()``, route its outputs to their queues,
   publish a stats snapshot, repeat.

Failures: a step that fails some requests (``StepFailedError``: a forward pass that raised,
logits that were not finite) fails only those, each with ``RequestFailedError`` (INTERNAL);
the loop goes on. When the engine cannot continue (``FailureTracker``: several failed steps in
a row with no progress, or any other exception of the thread) every request fails, new ones
are refused, the snapshot says ``failed`` and ``failed()`` returns.

Cancellation: when the async iterator returned by ``generate`` is closed or cancelled before its
request finished, an abort is queued at once, so a cancelled RPC frees its KV blocks on the next
turn of the engine loop. Close iterators promptly (``contextlib.aclosing``) rather than leaving
them to the garbage collector.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pdserve.engine.block_manager import BlockEvents
from pdserve.engine.engine import Engine
from pdserve.engine.faults import EngineFaults
from pdserve.engine.gate import ComputeGate
from pdserve.engine.guided import Guides
from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.engine.outputs import EngineStats, RequestOutput, StepFailedError
from pdserve.engine.request import EngineRequest
from pdserve.engine.sequence import LayerHook
from pdserve.engine.step_meter import StepMeter
from pdserve.engine_loop.batch_window import BatchWindow
from pdserve.engine_loop.coalesce import merge_ready
from pdserve.engine_loop.commands import (
    AbortCommand,
    AddCommand,
    CallCommand,
    Command,
    HandBackCommand,
    RequestStream,
    StopCommand,
    fail_queued,
    post_outputs,
)
from pdserve.engine_loop.state import (
    DEFAULT_MAX_CONSECUTIVE_FAILURES,
    EngineSnapshot,
    FailureTracker,
)
from pdserve.engine_loop.stream_table import StreamTable
from pdserve.errors import WorkerUnavailableError
from pdserve.hostmem import trim_heap
from pdserve.timing import RequestTiming

logger = logging.getLogger(__name__)

T = TypeVar("T")

TRIM_AFTER_S = 1.0
"""Idle this long after stepping, the engine thread hands freed heap back (``_idle_wait``)."""


class AsyncEngine:
    """An ``Engine`` on a dedicated thread with an asyncio API (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        *,
        batch_window_ms: float = 0.0,
        adaptive_window: bool = True,
    ) -> None:
        self._engine = engine
        self._failures = FailureTracker(DEFAULT_MAX_CONSECUTIVE_FAILURES)
        self._window = BatchWindow(batch_window_ms, adaptive=adaptive_window)  # engine thread
        # Immutable after construction, so readable from the event loop without the thread.
        self.layout: KVLayout = engine.layout
        self.vocab_size: int = engine.model_config.vocab_size
        self.max_model_len: int = engine.max_model_len
        self.max_num_batched_tokens: int = engine.config.max_num_batched_tokens
        self.max_num_seqs: int = engine.config.max_num_seqs
        self.guides: Guides = engine.guides  # thread-safe: compile guides ahead, off the thread
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._trim_pending = True
        """Stepped (or started) since the heap was last trimmed (``_idle_wait``)."""
        # Guards "accepting" together with the put, so that no command lands in the queue
        # after the engine thread's final drain (its sender would wait forever).
        self._gate = threading.Lock()
        self._accepting = False
        self._streams = StreamTable(engine)  # engine thread only
        self._num_steps = 0
        self._meter = StepMeter()  # engine thread
        self._snapshot = self._failures.snapshot(engine.stats(), (), 0)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.block_events: BlockEvents | None = None
        """The engine's prefix-cache change log, once one is installed (``kv_events``)."""

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        *,
        batch_window_ms: float = 0.0,
        faults: EngineFaults | None = None,
        **config: Any,
    ) -> AsyncEngine:
        """Load a checkpoint; ``config`` holds ``EngineConfig`` fields. Call ``start()`` next.

        ``faults``: failures to inject on purpose, for fault tests only."""
        engine = Engine.from_pretrained(model_dir, faults=faults, **config)
        return cls(engine, batch_window_ms=batch_window_ms)

    @property
    def engine(self) -> Engine:
        """The wrapped engine: touch it only before ``start()`` or after ``close()``."""
        if self.running:
            raise RuntimeError("the engine belongs to its thread while the AsyncEngine runs")
        return self._engine

    @property
    def gate(self) -> ComputeGate:
        """How the engine shares its device (set on the engine before ``start()``)."""
        return self._engine.gate

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Stop the thread: abort every request (their iterators raise), free every block."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        self._submit(StopCommand(), required=False)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _submit(self, command: Command, *, required: bool = True) -> None:
        """Queue a command for the engine thread.

        When the thread no longer takes commands: raise ``WorkerUnavailableError`` if
        ``required``, else drop it (an abort or stop has nothing left to do then).
        """
        with self._gate:
            if self._accepting and not (required and self._closed):
                self._commands.put(command)
                return
        if required:
            if self._failures.fatal is not None:
                raise WorkerUnavailableError(f"the engine failed: {self._failures.fatal!r}")
            raise WorkerUnavailableError("the engine is not running")

    # -- the async API ---------------------------------------------------------------------
    async def generate(
        self,
        request: EngineRequest,
        *,
        hold_kv: bool = False,
        kv: KVPayload | None = None,
        first_token: tuple[int, float] | None = None,
        timing: RequestTiming | None = None,
        layer_hook: LayerHook | None = None,
        coalesce: bool = False,
        generated: Sequence[int] = (),
    ) -> AsyncGenerator[RequestOutput, None]:
        """Run one request; yields its outputs, the last one ``finished``.

        With ``coalesce``, the outputs of several steps that are already waiting when the
        consumer asks for the next one are merged into one (tokens, logprobs and text in
        order; the last one's finish): a consumer that fell behind catches up in one
        message, and one that keeps up gets every output as soon as it exists. The first
        output is never merged: it goes out alone, as early as possible.

        Errors of ``Engine.add_request`` (``InvalidArgumentError`` and the like) are raised by
        the first ``__anext__``. Closing the iterator early aborts the request. With
        ``hold_kv`` the finished request keeps its blocks: call ``export_and_release`` or
        ``abort``; closing the iterator before it yielded the finished output releases them
        too. The request's ``reservation_id`` is listed in ``snapshot().tags`` while it is admitted;
        ``timing`` is filled in as the request runs. ``generated``: output tokens another
        engine drew before the request migrated here (``Engine.add_request``).

        ``layer_hook`` runs **on the engine thread**, inside the forward pass of the prompt's
        last chunk, once per layer with views valid only during the call (see
        ``pdserve.engine.sequence.LayerHook``): copy what you keep, hand heavy work to another
        thread, and never raise (an exception fails the engine's whole batch).
        """
        stream = RequestStream(
            request.request_id,
            asyncio.get_running_loop(),
            asyncio.Queue(),
            timing or RequestTiming(),
            request.reservation_id,
            hold_kv,
        )
        self._submit(AddCommand(stream, request, kv, first_token, layer_hook, generated))
        finished = False
        yielded = False
        try:
            while True:
                item = await stream.queue.get()
                if coalesce and yielded:  # the first output always goes out on its own
                    item = merge_ready(item, stream.queue)
                if isinstance(item, BaseException):
                    finished = True  # refused or shut down: nothing left to abort
                    raise item
                if item.finished:
                    finished = True
                yield item
                yielded = True
                if finished:
                    return
        finally:
            if not finished:
                self._submit(AbortCommand(request.request_id, stream), required=False)

    def abort(self, request_id: str) -> None:
        """Queue an abort (or release of held KV) of ``request_id``; it runs before any later
        command, so a following ``call`` sees its effect."""
        self._submit(AbortCommand(request_id, None), required=False)

    def hand_back(self, why: str) -> None:
        """End every running stream with ``HandedBackError(why)`` and free its KV, so that
        whoever reads it continues the request elsewhere (the router migrates it); held
        KV (prefills waiting for export) stays. Queued like ``abort``."""
        self._submit(HandBackCommand(why), required=False)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its result or exception."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._submit(CallCommand(fn, future))
        return await asyncio.wrap_future(future)

    async def export_and_release(self, request_id: str) -> KVPayload:
        """Copy a finished ``hold_kv`` request's KV and free its blocks, in one engine turn.

        The blocks are freed even if the export fails.
        """
        return await self.call(lambda _engine: self._streams.export(request_id))

    def stats(self) -> EngineStats:
        """The stats as of the engine thread's last turn (no lock, no waiting)."""
        return self._snapshot.stats

    def snapshot(self) -> EngineSnapshot:
        """Stats, admitted tags and step count as of the engine thread's last turn."""
        return self._snapshot

    async def failed(self) -> BaseException:
        """Wait until the engine thread stops on a failure it cannot recover from (see the
        module docstring); returns that failure. Never returns if the engine is closed."""
        return await self._failures.failed()

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # the engine's state is unknown now
            logger.exception("engine thread failed; failing every request")
            self._shutdown(err)
            self._failures.set_fatal(err)
        else:
            self._shutdown(None)

    def _loop(self) -> None:
        """Serve commands and step until a stop command."""
        while True:
            idle = not self._engine.has_unfinished()
            if idle:
                self._publish()
                self._engine.gate.idle()  # no bulk work to announce to the host's engines
                if not self._apply(self._idle_wait()):
                    return
            if not self._drain():
                return
            # The window opens whenever work arrives at an idle engine, whichever command
            # brought it (a request queued behind a call counts as well).
            gather = idle and self._window.opens and self._engine.has_unfinished()
            if gather and not self._window.gather(self._commands, self._apply, self._full):
                return
            if self._engine.has_unfinished():
                self._step()

    def _idle_wait(self) -> Command:
        """Block for work. The first time the engine sits idle ``TRIM_AFTER_S`` after
        starting or stepping, hand the heap freed since back to the system
        (``hostmem.trim_heap``): here, off every request's path, an idle worker stops
        holding its start-up's and its busiest moment's garbage."""
        if self._trim_pending:
            try:
                return self._commands.get(timeout=TRIM_AFTER_S)
            except queue.Empty:
                self._trim_pending = False
                trim_heap()
        return self._commands.get()

    def _full(self) -> bool:
        """The next step's budget is reached: nothing more would join it."""
        stats, cfg = self._engine.stats(), self._engine.config
        return stats.queued_tokens >= cfg.max_num_batched_tokens or (
            stats.num_waiting >= cfg.max_num_seqs
        )

    def _drain(self) -> bool:
        """Apply every queued command without blocking; False on stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if not self._apply(command):
                return False

    def _apply(self, command: Command) -> bool:
        if isinstance(command, StopCommand):
            return False
        if isinstance(command, AddCommand):
            self._window.added()
            self._streams.add(command)
        elif isinstance(command, AbortCommand):
            self._streams.abort(command.request_id, command.stream)
        elif isinstance(command, HandBackCommand):
            self._streams.hand_back(command.why)
        elif command.future.set_running_or_notify_cancel():
            try:
                command.future.set_result(command.fn(self._engine))
            except Exception as err:  # delivered to the awaiting caller
                command.future.set_exception(err)
        return True

    def _step(self) -> None:
        started = time.perf_counter()
        self._streams.stepping(started)
        self._window.stepped()
        self._trim_pending = True
        try:
            outputs = self._engine.step()
        except StepFailedError as err:  # the engine aborted the failed requests itself
            outputs = err.outputs
            self._streams.fail(err)
            if self._failures.step_failed(len(err.failures), progressed=bool(outputs)):
                raise
        else:
            self._failures.step_succeeded()
        self._num_steps += 1
        ended = time.perf_counter()
        shape = self._engine.last_step
        self._meter.observe(shape.prefill_tokens, shape.decodes, started, ended)
        post_outputs(self._streams.route(outputs, ended))
        self._publish()

    def _publish(self) -> None:
        tags = self._streams.tags()
        stats, steps = self._engine.stats(), self._meter.reading()
        self._snapshot = self._failures.snapshot(stats, tags, self._num_steps, steps)

    def _shutdown(self, failure: BaseException | None) -> None:
        """Abort everything, fail every waiter, publish the final (empty) state."""
        why = "shut down" if failure is None else f"failed: {failure!r}"
        closed = WorkerUnavailableError(f"the engine {why}")
        with self._gate:
            self._accepting = False
        fail_queued(self._commands, closed)  # commands that arrived after the stop
        self._streams.close(closed, abort=failure is None)
        self._closed = True
        if failure is None:
            self._publish()
        else:
            self._snapshot = self._failures.lost(self._snapshot)
