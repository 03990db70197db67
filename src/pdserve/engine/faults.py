"""Faults the engine injects on purpose, for fault tests only (never set in production).

They exercise the engine's failure paths with a real model: ``nan_prefix`` makes the model's
logits of a request NaN (what a numerically broken model produces; its row fails in the
sampler, the rest of the batch carries on), ``step_prefix`` makes a step that computes a
request raise as a whole (what a failing forward pass or layer hook does).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class EngineFaults:
    """Each fault applies to the requests whose id starts with its prefix (None: off; "": all)."""

    nan_prefix: str | None = None
    """The logits sampled for such a request are NaN."""
    step_prefix: str | None = None
    """A step with such a request in its batch raises before its forward pass."""

    def nan_logits(self, seq: Sequence) -> bool:
        return self.nan_prefix is not None and seq.request_id.startswith(self.nan_prefix)

    def fails_step(self, seqs: Iterable[Sequence]) -> bool:
        prefix = self.step_prefix
        return prefix is not None and any(s.request_id.startswith(prefix) for s in seqs)
