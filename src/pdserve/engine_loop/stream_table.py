"""The streams of the requests ``AsyncEngine``'s engine thread runs or holds, apart from its
loop: every way a request leaves (finished, held, aborted, failed, handed back) in one place."""

from __future__ import annotations

import logging

from pdserve.engine.engine import Engine
from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.outputs import RequestOutput, StepFailedError
from pdserve.engine_loop.commands import AddCommand, Deliveries, RequestStream
from pdserve.errors import HandedBackError

logger = logging.getLogger(__name__)


class StreamTable:
    """The streams running, held or not yet stepped. Engine thread only, like the engine it
    aborts requests in: nothing here is thread-safe."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._running: dict[str, RequestStream] = {}
        self._unstarted: list[RequestStream] = []  # admitted, no step yet
        # Finished hold_kv requests and the stream each finished on (an abort from that stream
        # still releases them: its consumer left before it saw the end).
        self._held: dict[str, RequestStream] = {}

    def add(self, command: AddCommand) -> None:
        stream = command.stream
        try:
            self._engine.add(
                command.request,
                hold_kv=stream.hold_kv,
                kv=command.kv,
                first_token=command.first_token,
                layer_hook=command.layer_hook,
                generated=command.generated,
            )
        except Exception as err:  # delivered to the generate() caller
            stream.post(err)
            return
        self._running[stream.request_id] = stream
        self._unstarted.append(stream)

    def abort(self, rid: str, stream: RequestStream | None) -> None:
        """Abort ``rid`` if ``stream`` is still its own (None: whatever runs under it)."""
        if stream is not None and self._running.get(rid) is not stream:
            # Finished already, or the id now belongs to another request. A hold_kv request
            # that finished on this very stream still holds blocks its consumer never learnt
            # about (it left before reading the last output): release them.
            if self._held.get(rid) is stream:
                del self._held[rid]
                self._engine.abort(rid)
            return
        self._running.pop(rid, None)
        self._held.pop(rid, None)
        self._engine.abort(rid)

    def export(self, rid: str) -> KVPayload:
        try:
            return self._engine.export_kv(rid)
        finally:
            self._engine.abort(rid)  # frees held blocks; no-op if they are gone
            self._held.pop(rid, None)

    def hand_back(self, why: str) -> None:
        """End every running stream with ``HandedBackError(why)``; held ones stay."""
        handed = [s for s in self._running.values() if not s.hold_kv]
        if handed:
            logger.info("handing %d running requests back: %s", len(handed), why)
        for stream in handed:
            self.abort(stream.request_id, stream)
            stream.post(HandedBackError(why))

    def stepping(self, started: float) -> None:
        """A step starts at ``started``: the first for the requests admitted since the last."""
        for admitted in self._unstarted:
            admitted.timing.first_step_start = started
        self._unstarted.clear()

    def fail(self, err: StepFailedError) -> None:
        """Tell the streams of the requests a step failed (already aborted in the engine)."""
        for rid, why in err.failures.items():
            logger.error("request %s failed in an engine step: %s", rid, why)
            self._held.pop(rid, None)
            stream = self._running.pop(rid, None)
            if stream is not None:
                stream.post(why)

    def route(self, outputs: list[RequestOutput], ended: float) -> Deliveries:
        """A step's ``outputs`` (ended at ``ended``, ``perf_counter``) by their consumers' event
        loop; stamps their timing. A finished request stops running (held if it holds its KV)."""
        deliveries: Deliveries = {}
        for out in outputs:
            stream = self._running.get(out.request_id)
            if stream is None:
                continue  # aborted after this step was scheduled
            if stream.timing.first_output is None:
                stream.timing.first_output = ended
                stream.timing.first_batch_size = len(outputs)
            stream.timing.last_output = ended
            if out.finished:
                del self._running[out.request_id]
                if stream.hold_kv:
                    self._held[out.request_id] = stream
            deliveries.setdefault(stream.loop, []).append((stream, out))
        return deliveries

    def tags(self) -> tuple[str, ...]:
        """The reservation ids of the running requests."""
        return tuple(s.reservation_id for s in self._running.values() if s.reservation_id)

    def close(self, closed: Exception, *, abort: bool) -> None:
        """Forget every stream, ending the running ones with ``closed``; ``abort``: free all
        their blocks first (not when the engine's state is unknown)."""
        if abort:
            for rid in [*self._running, *self._held]:
                self._engine.abort(rid)
        for stream in self._running.values():
            stream.post(closed)
        self._running.clear()
        self._held.clear()
        self._unstarted.clear()
