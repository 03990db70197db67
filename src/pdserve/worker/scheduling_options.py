"""The worker flags that concern cluster scheduling: lane, waiting order, KV events.

Kept apart from ``options`` (the engine and hand-off flags) and folded into
``WorkerOptions.scheduling``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.worker_info import DUTIES, LANES

WAITING_ORDERS = ("fcfs", "short_first")


@dataclass(frozen=True, slots=True)
class SchedulingOptions:
    """How a worker presents itself to the scheduler, and orders its own queue."""

    lane: str = "any"
    """Prompt lengths whose prefill this worker takes (``worker_info.LANES``)."""
    waiting_order: str = "fcfs"
    """The engine's waiting queue: ``fcfs`` or ``short_first`` (``EngineConfig``)."""
    aging_tokens_per_s: float = 2000.0
    kv_events: bool = True
    """Publish prefix-cache changes for the scheduler's KV-aware placement."""
    duty: str = ""
    """A mixed worker's duty until a planner orders another (``worker.duty``)."""

    def __post_init__(self) -> None:
        if self.lane not in LANES:
            raise InvalidArgumentError("--lane", f"must be one of {LANES}, got {self.lane!r}")
        if self.waiting_order not in WAITING_ORDERS:
            raise InvalidArgumentError(
                "--waiting-order", f"must be one of {WAITING_ORDERS}, got {self.waiting_order!r}"
            )
        if not self.aging_tokens_per_s > 0:
            raise InvalidArgumentError("--aging-tokens-per-s", "must be > 0")
        if self.duty not in DUTIES:
            raise InvalidArgumentError("--duty", f"must be one of {DUTIES}, got {self.duty!r}")

    def engine_config(self) -> dict[str, Any]:
        return {"waiting_order": self.waiting_order, "aging_tokens_per_s": self.aging_tokens_per_s}


def add_scheduling_args(p: argparse.ArgumentParser, d: Callable[[str, Any], Any]) -> None:
    """Add the flags; ``d(flag, default)`` reads a default from the environment."""
    g = p.add_argument_group("scheduling (see docs/scheduling.md)")
    g.add_argument(
        "--lane",
        choices=LANES,
        default=d("lane", "any"),
        help="prefill only prompts above (long) or below (short) the scheduler's long-prompt "
        "threshold; any: every prompt",
    )
    g.add_argument(
        "--waiting-order",
        choices=WAITING_ORDERS,
        default=d("waiting_order", "fcfs"),
        help="which waiting prompt the engine admits next: arrival order, or the one with the "
        "fewest tokens to compute (aged by its wait)",
    )
    g.add_argument(
        "--aging-tokens-per-s",
        type=float,
        default=float(d("aging_tokens_per_s", 2000.0)),
        help="short_first: a waiting prompt counts this many tokens fewer per second waited",
    )
    g.add_argument(
        "--duty",
        choices=[d for d in DUTIES if d],
        default=d("duty", None),
        help="mixed worker: start on prefill or decode duty (default: everything it can); "
        "a planner may move it later",
    )
    g.add_argument(
        "--no-kv-events",
        dest="kv_events",
        action="store_false",
        default=d("kv_events", "1") != "0",
        help="do not publish prefix-cache changes (KV-aware placement then sees none here)",
    )


def scheduling_options(args: argparse.Namespace) -> SchedulingOptions:
    return SchedulingOptions(
        lane=args.lane,
        waiting_order=args.waiting_order,
        aging_tokens_per_s=args.aging_tokens_per_s,
        kv_events=args.kv_events,
        duty=args.duty or "",
    )
