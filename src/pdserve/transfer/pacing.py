"""How a reader that follows its writer paces its polls of the writer's per-layer marks (the
shm follower's reads of the segment, the nixl follower's small READs).

A backoff from ``WAIT_MIN_S`` to ``WAIT_MAX_S``; once the next layer is due (``due_after``:
``NEAR`` of the previous interval between marks has passed again), pauses of at most
``WAIT_NEAR_S`` for ``NEAR_WINDOW_S``, after which the backoff grows again, so a stalled
writer costs little. Polling, because neither a mapped segment nor a remote pool can wake a
reader in another process.
"""

from __future__ import annotations

from collections.abc import Sequence

WAIT_MIN_S = 50e-6
WAIT_MAX_S = 2e-3
WAIT_NEAR_S = 100e-6
"""The longest pause once the awaited mark is due ..."""
NEAR_WINDOW_S = 50e-3
"""... for this long."""
NEAR = 0.75
"""A layer is due when this share of the previous layer's interval has passed."""


def due_after(seen: Sequence[float]) -> float:
    """When the next mark is due (monotonic seconds), from the times the last two were found
    (infinity before two)."""
    if len(seen) < 2:
        return float("inf")
    return seen[-1] + NEAR * (seen[-1] - seen[-2])


def next_wait(delay: float, due: float, now: float) -> float:
    """The pause after one of ``delay`` that found nothing, at ``now``."""
    near = 0.0 <= now - due < NEAR_WINDOW_S
    return min(2 * delay, WAIT_NEAR_S if near else WAIT_MAX_S)
