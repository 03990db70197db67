"""Where one request's time went: the raw record and the one derived ``Timing``.

``RequestTiming`` is the raw record: ``time.perf_counter()`` stamps the engine thread fills in
as the request runs on a worker. ``Timing`` is what every layer reports (the ``Timing`` proto,
the decode worker's last delta, the prefill's result, the router's last chunk, the client's
result): milliseconds per stage plus the hand-off's size and transport. Every figure of a
``Timing`` is derived here, from a ``RequestTiming`` (``RequestTiming.prefill`` /
``.decode`` / ``.generate``) or by merging the decode side's into the prefill side's
(``Timing.after_decode``, ``Timing.after_generate``); nothing else computes them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

RECOMPUTE = "recompute"
"""The transport name of a hand-off in which no KV moved: the decode worker prefilled."""


@dataclass(frozen=True, slots=True)
class Timing:
    """Where the time of one request went, in milliseconds (bytes for ``transfer_bytes``).

    On a worker the figures are its own; at the router ``queue_ms`` covers the scheduler
    decision and the worker queues, and ``ttft_ms`` and ``e2e_ms`` are measured from the moment
    the request arrived.
    """

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    """Mixed: the prefill. Decode: the prefill this worker ran itself (recompute)."""
    transfer_ms: float = 0.0
    """Prefill: the hand-off not hidden behind the compute. Decode: receiving the KV (a failed
    attempt included), until it was ready to import."""
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    transfer_bytes: int = 0
    transport: str = ""

    def after_decode(self, decode: Timing) -> Timing:
        """This (the prefill side's) timing with the decode worker's added.

        The decode side's figures are the ones that held: when its receive failed, or when
        nothing was sent, it prefilled the prompt itself (``transport == "recompute"``). That
        recompute is prefill work on the request's path, so it adds to ``prefill_ms``; the
        failed receive's time stays in ``transfer_ms``, and no KV reached the decode worker.
        """
        return dataclasses.replace(
            self,
            queue_ms=self.queue_ms + decode.queue_ms,
            prefill_ms=self.prefill_ms + decode.prefill_ms,
            transfer_ms=self.transfer_ms + decode.transfer_ms,
            decode_ms=decode.decode_ms,
            transport=decode.transport or self.transport,
            transfer_bytes=(
                decode.transfer_bytes if decode.transport == RECOMPUTE else self.transfer_bytes
            ),
        )

    def after_generate(self, worker: Timing) -> Timing:
        """This (the router's) timing with a mixed worker's colocated run added."""
        return dataclasses.replace(
            self,
            queue_ms=self.queue_ms + worker.queue_ms,
            prefill_ms=worker.prefill_ms,
            decode_ms=worker.decode_ms,
        )


@dataclass(slots=True)
class RequestTiming:
    """``time.perf_counter()`` stamps of one request on one worker, filled in as it runs."""

    submitted: float = field(default_factory=time.perf_counter)
    """When ``generate`` was called."""
    first_step_start: float | None = None
    """Start of the first engine step after the engine admitted the request."""
    first_output: float | None = None
    """End of the step that produced the request's first output."""
    last_output: float | None = None
    """End of the step that produced its latest output."""
    first_batch_size: int = 0
    """Requests that got an output from the step that produced this one's first output."""

    @property
    def queue_ms(self) -> float:
        """Waiting before the first step: command queue, batching window, busy engine."""
        return _ms(self.submitted, self.first_step_start)

    @property
    def first_output_ms(self) -> float:
        """Steps until the first output (the prefill, chunks included)."""
        return _ms(self.first_step_start, self.first_output)

    @property
    def after_first_ms(self) -> float:
        """From the first output to the latest one (the decode)."""
        return _ms(self.first_output, self.last_output)

    @property
    def steps_ms(self) -> float:
        """From the first step to the latest output."""
        return _ms(self.first_step_start, self.last_output)

    @property
    def ttft_ms(self) -> float:
        """From ``generate`` to the first output."""
        return _ms(self.submitted, self.first_output)

    @property
    def e2e_ms(self) -> float:
        """From ``generate`` to the latest output."""
        return _ms(self.submitted, self.last_output)

    # -- the derived Timing of each kind of run ------------------------------------------------

    def prefill(
        self, *, transfer_ms: float = 0.0, transfer_bytes: int = 0, transport: str = ""
    ) -> Timing:
        """A prefill worker's: its queue, the prefill's steps, the exposed hand-off."""
        return Timing(
            queue_ms=self.queue_ms,
            prefill_ms=self.first_output_ms,
            transfer_ms=transfer_ms,
            transfer_bytes=transfer_bytes,
            transport=transport,
        )

    def decode(
        self,
        *,
        started: float,
        recompute_ms: float,
        transfer_ms: float,
        transfer_bytes: int,
        transport: str,
    ) -> Timing:
        """A decode worker's after a hand-off: ``started`` is the ``perf_counter`` time the
        call arrived (its e2e covers the KV's arrival); ``recompute_ms`` a prefill it ran
        itself."""
        return Timing(
            queue_ms=self.queue_ms,
            prefill_ms=recompute_ms,
            transfer_ms=transfer_ms,
            decode_ms=self.steps_ms,
            e2e_ms=_since(started),
            transfer_bytes=transfer_bytes,
            transport=transport,
        )

    def generate(self, *, started: float | None = None, transport: str = "") -> Timing:
        """A run that prefilled and decoded here (mixed, or a migrated request): from
        ``started`` (a ``perf_counter`` time, before the engine call) when given, else from
        the engine call; a migration reports no time to first token."""
        return Timing(
            queue_ms=self.queue_ms,
            prefill_ms=self.first_output_ms,
            decode_ms=self.after_first_ms,
            ttft_ms=self.ttft_ms if started is None else 0.0,
            e2e_ms=self.e2e_ms if started is None else _since(started),
            transport=transport,
        )


def _ms(start: float | None, end: float | None) -> float:
    return 0.0 if start is None or end is None else max(0.0, (end - start) * 1000.0)


def _since(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0
