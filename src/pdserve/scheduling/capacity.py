"""Capacity arithmetic: what a request needs on a worker and whether the worker has it.

Pure functions over heartbeat data; no I/O. The scheduler runs the same check twice: once on
its cached view to pick candidates, and once more under WATCH on fresh data before committing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from pdserve.errors import CapacityError, InvalidArgumentError, WorkerUnavailableError
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole


class Phase(StrEnum):
    """Which part of a request a worker is asked to serve."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"
    """Prefill and decode on one mixed worker."""

    @property
    def role(self) -> WorkerRole:
        """The worker role that serves this phase."""
        return _ROLE_OF_PHASE[self]


_ROLE_OF_PHASE = {
    Phase.PREFILL: WorkerRole.PREFILL,
    Phase.DECODE: WorkerRole.DECODE,
    Phase.COLOCATED: WorkerRole.MIXED,
}


@dataclass(frozen=True, slots=True)
class Claim:
    """Resources one reservation holds on one worker (or a sum of several)."""

    tokens: int = 0
    """Prompt tokens still to prefill (counts against the worker's queue)."""
    blocks: int = 0
    """KV blocks the request will occupy."""

    def __add__(self, other: Claim) -> Claim:
        return Claim(self.tokens + other.tokens, self.blocks + other.blocks)

    def __sub__(self, other: Claim) -> Claim:
        return Claim(max(0, self.tokens - other.tokens), max(0, self.blocks - other.blocks))


@dataclass(frozen=True, slots=True)
class Demand:
    """One phase of one request, as the placement policy sees it."""

    prompt_tokens: int
    max_tokens: int
    phase: Phase
    cached_tokens: Callable[[str], int] | None = field(default=None, compare=False)
    """Worker id -> prompt tokens its prefix cache holds (``prefix_index``); None: unknown."""

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 1:
            raise InvalidArgumentError("prompt_tokens", f"must be >= 1, got {self.prompt_tokens!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgumentError("max_tokens", f"must be >= 1, got {self.max_tokens!r}")
        object.__setattr__(self, "phase", Phase(self.phase))

    def uncached(self, worker_id: str) -> int:
        """Prompt tokens the worker would compute (all but the last one may be cached)."""
        cached = self.cached_tokens(worker_id) if self.cached_tokens is not None else 0
        return max(1, self.prompt_tokens - cached)

    def claim(self, block_size: int) -> Claim:
        """What this phase reserves on a worker with ``block_size`` tokens per KV block.

        Prefill holds the prompt's blocks and queues its tokens; decode holds blocks for the
        prompt plus every token it may generate; colocated does both on one worker.
        """
        if self.phase is Phase.PREFILL:
            return Claim(self.prompt_tokens, math.ceil(self.prompt_tokens / block_size))
        blocks = math.ceil((self.prompt_tokens + self.max_tokens) / block_size)
        tokens = self.prompt_tokens if self.phase is Phase.COLOCATED else 0
        return Claim(tokens, blocks)


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A worker's last heartbeat plus the reservations it has not admitted yet."""

    info: WorkerInfo
    reserved: Claim = Claim()
    """Sum of live reservations on the worker that its heartbeat does not include yet."""
    heartbeat_age_s: float = 0.0

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def free_blocks(self) -> int:
        """KV blocks neither used nor promised to a reservation (may be < 0 if over-committed)."""
        return self.info.kv_blocks_free - self.reserved.blocks

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens queued on the worker or reserved for it."""
        return self.info.queued_tokens + self.reserved.tokens

    def with_reserved(self, reserved: Claim) -> WorkerView:
        return WorkerView(self.info, reserved, self.heartbeat_age_s)


PREFILL_QUEUE_BATCHES = 4.0
"""The default of ``CapacityLimits.prefill_queue_batches`` (the scheduler's and the planner's
``--prefill-queue-batches``)."""


@dataclass(frozen=True, slots=True)
class CapacityLimits:
    """Admission limits on top of the KV block budget."""

    prefill_queue_batches: float = PREFILL_QUEUE_BATCHES
    """A worker's pending prompt tokens may reach this many of its forward batches
    (``max_batch_tokens``); beyond that a request waits less elsewhere."""

    def __post_init__(self) -> None:
        if not self.prefill_queue_batches > 0:
            raise InvalidArgumentError(
                "prefill_queue_batches", f"must be > 0, got {self.prefill_queue_batches}"
            )

    def max_pending_tokens(self, info: WorkerInfo) -> int:
        return int(self.prefill_queue_batches * info.max_batch_tokens)


def shortfall(view: WorkerView, claim: Claim, limits: CapacityLimits) -> str | None:
    """Why ``view`` cannot take ``claim`` on top of what it holds, or None if it can.

    An idle queue always accepts one prompt, however long: otherwise a prompt longer than the
    queue limit could never be placed (the worker prefills it in chunks).
    """
    if claim.blocks > view.free_blocks:
        return (
            f"needs {claim.blocks} KV blocks, {max(0, view.free_blocks)} of "
            f"{view.info.kv_blocks_total} free after reservations"
        )
    if claim.tokens and view.pending_tokens > 0:
        limit = limits.max_pending_tokens(view.info)
        if view.pending_tokens + claim.tokens > limit:
            return (
                f"queue holds {view.pending_tokens} prompt tokens, "
                f"{claim.tokens} more exceed its limit of {limit}"
            )
    return None


STALE_AFTER_INTERVALS = 2.0
"""A worker whose last heartbeat is older than this many of its intervals is gone: it missed
two beats in a row (its key lives three intervals, a margin for a slow Redis write)."""


def stale(view: WorkerView) -> bool:
    """True when the worker's heartbeat is too old for it to be alive."""
    interval = view.info.interval_s
    return interval > 0 and view.heartbeat_age_s > STALE_AFTER_INTERVALS * interval


def ineligibility(view: WorkerView, phase: Phase, model_fingerprint: str | None) -> str | None:
    """Why ``view`` must not serve ``phase`` regardless of load, or None."""
    if phase.value not in view.info.phases:
        serves = ", ".join(view.info.phases) or "nothing"
        switching = " (changing duty)" if view.info.switching else ""
        return f"role {view.info.role.value} serves {serves}{switching}, not {phase.value}"
    if view.info.draining:
        return "draining"
    if model_fingerprint is not None and view.info.model_fingerprint != model_fingerprint:
        return (
            f"model fingerprint {view.info.model_fingerprint!r} differs from {model_fingerprint!r}"
        )
    return None


def capacity_error(
    views: Iterable[WorkerView],
    excluded: Mapping[str, str],
    gone: Collection[str],
    limits: CapacityLimits,
    request_id: str,
    prompt_tokens: int,
    max_tokens: int,
    phase: str,
) -> CapacityError | WorkerUnavailableError:
    """Why no worker took ``phase`` of a request: RESOURCE_EXHAUSTED naming each live worker
    of that phase and what it lacks, or UNAVAILABLE when none is alive. ``excluded``: workers
    that failed the re-check in this call or that the caller excluded, and why (a reason in
    ``gone``: the worker is not alive for this request)."""
    alive = [
        v
        for v in views
        if phase in v.info.phases and not v.info.draining and excluded.get(v.id) not in gone
    ]
    what = f"request {request_id!r} (prompt {prompt_tokens}, max_tokens {max_tokens})"
    role = Phase(phase).role
    if not alive:
        return WorkerUnavailableError(f"{what}: no live, non-draining {role.value} worker")

    def why_not(view: WorkerView) -> str:
        claim = Demand(prompt_tokens, max_tokens, Phase(phase)).claim(view.info.block_size)
        if phase == Phase.PREFILL:
            fallback = "its model differs from every decode worker with room"
        else:
            fallback = "no prefill worker with its model has room"
        return shortfall(view, claim, limits) or fallback

    details = "; ".join(
        f"{v.id}: {excluded.get(v.id) or why_not(v)}" for v in sorted(alive, key=lambda v: v.id)
    )
    return CapacityError(f"{what}: every {role.value} worker is full ({details})")
