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
from pdserve.scheduling.costmodel import CostModel, decoding


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


class KvAware:
    """Prefers the worker that would finish the request's phase soonest, by the cost model,
    counting the prompt blocks its prefix cache already holds (``prefix_index``).

    * prefill / colocated: no stall of its decoding streams past the ITL SLO first, then the
      least predicted time to the first token (queue wait + computing the uncached tokens);
    * decode: no queued prefill work that would stall a new stream past the ITL SLO first,
      then the shortest predicted decode step with one more sequence, then the most free
      blocks.

    Like the KV routers of Dynamo and llm-d (cached blocks against load), but both sides of
    the trade are in seconds. Ties go to the smaller id.
    """

    name = "kv_aware"

    def __init__(self, model: CostModel) -> None:
        self.model = model

    def choose(self, candidates: Sequence[WorkerView], demand: Demand) -> list[WorkerView]:
        m = self.model
        if demand.phase is Phase.DECODE:

            def decode_key(v: WorkerView) -> tuple[bool, float, int, str]:
                stalled = m.stall_s(v.info, v.pending_tokens) > m.itl_budget_s(v)
                return (stalled, m.decode_step_s(v.info, decoding(v) + 1), -v.free_blocks, v.id)

            return sorted(candidates, key=decode_key)

        def key(v: WorkerView) -> tuple[bool, float, int, str]:
            uncached = demand.uncached(v.id)
            ttft = m.queue_s(v) + m.prefill_s(v.info, uncached, decodes=decoding(v))
            return (m.harms_itl(v, uncached), ttft, -v.free_blocks, v.id)

        return sorted(candidates, key=key)


POLICIES: Mapping[str, Callable[[CostModel], PlacementPolicy]] = MappingProxyType(
    {
        RoundRobin.name: lambda _model: RoundRobin(),
        LeastLoaded.name: lambda _model: LeastLoaded(),
        KvAware.name: KvAware,
    }
)
"""Policy name -> factory (given the scheduler's cost model). Read-only; add a policy by
adding it here."""


def make_policy(name: str, model: CostModel | None = None) -> PlacementPolicy:
    """A fresh instance of the policy registered as ``name``."""
    try:
        factory = POLICIES[name]
    except KeyError:
        allowed = ", ".join(sorted(POLICIES))
        raise InvalidArgumentError(
            "policy", f"unknown policy {name!r}; choose one of {allowed}"
        ) from None
    return factory(model or CostModel())
