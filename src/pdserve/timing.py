"""RequestTiming: where one request's time went inside a worker, from engine-thread stamps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestTiming:
    """``time.perf_counter()`` stamps of one request, filled in as it runs."""

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


def _ms(start: float | None, end: float | None) -> float:
    return 0.0 if start is None or end is None else max(0.0, (end - start) * 1000.0)
