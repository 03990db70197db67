"""Placement policies: order the workers that could take a request, best first.

A policy only ranks. The scheduler has already dropped candidates that are draining, of the
wrong role or model, or too full for the request (on its cached view), and it re-checks the
winner against fresh data before committing; so a policy may be wrong about load without
ever over-committing a worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.capacity import Demand, Phase, WorkerView


class PlacementPolicy(Protocol):
    """Ranks candidate workers for one phase of one request."""

    name: str
    """The key under which the policy is registered in ``POLICIES``."""

    def choose(self, candidates: Sequence[WorkerView], demand: Demand) -> list[WorkerView]:
        """Return ``candidates`` (all of them, none added) ordered best first.

        Called once per decision with a non-empty sequence; may keep state between calls
        (RoundRobin does) but must not block.
        """
        ...


class RoundRobin:
    """Takes the workers in turn (by id), one rotation per phase, ignoring load."""

    name = "round_robin"

    def __init__(self) -> None:
        # Separate turns per phase so prefill and decode placements rotate independently.
        self._turn: dict[Phase, int] = {}

    def choose(self, candidates: Sequence[WorkerView], demand: Demand) -> list[WorkerView]:
        ordered = sorted(candidates, key=lambda v: v.id)
        if not ordered:
            return []
        turn = self._turn.get(demand.phase, 0)
        self._turn[demand.phase] = turn + 1
        start = turn % len(ordered)
        return ordered[start:] + ordered[:start]


class LeastLoaded:
    """Prefers the worker with the most room for the request's phase.

    * decode / colocated: most free KV blocks after reservations (the scarce resource while
      generating), then the shortest prompt queue;
    * prefill: the shortest prompt queue measured in forward batches (pending tokens divided by
      ``max_batch_tokens``, a proxy for the wait), then the most free blocks.

    Ties go to the smaller id, so the order is deterministic.
    """

    name = "least_loaded"

    def choose(self, candidates: Sequence[WorkerView], demand: Demand) -> list[WorkerView]:
        if demand.phase is Phase.PREFILL:
            return sorted(
                candidates,
                key=lambda v: (_queue_batches(v), -v.free_blocks, v.id),
            )
        return sorted(candidates, key=lambda v: (-v.free_blocks, v.pending_tokens, v.id))


def _queue_batches(view: WorkerView) -> float:
    return view.pending_tokens / max(1, view.info.max_batch_tokens)


POLICIES: Mapping[str, Callable[[], PlacementPolicy]] = MappingProxyType(
    {RoundRobin.name: RoundRobin, LeastLoaded.name: LeastLoaded}
)
"""Policy name -> factory. Read-only; add a policy by adding it here."""


def make_policy(name: str) -> PlacementPolicy:
    """A fresh instance of the policy registered as ``name``."""
    try:
        factory = POLICIES[name]
    except KeyError:
        allowed = ", ".join(sorted(POLICIES))
        raise InvalidArgumentError(
            "policy", f"unknown policy {name!r}; choose one of {allowed}"
        ) from None
    return factory()
