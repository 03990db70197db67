"""The worker flags that concern cluster scheduling: lane, waiting order, KV events.

Kept apart from ``options`` (the engine and hand-off flags) and folded into
``WorkerOptions.scheduling``; each field is its flag (``pdserve.settings``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError
from pdserve.scheduling.worker_info import DUTIES, LANES
from pdserve.settings import setting

WAITING_ORDERS = ("fcfs", "short_first")
DUTY_SWITCHES = ("migrate", "drain")
SCHEDULING = "scheduling (see docs/scheduling.md)"


@dataclass(frozen=True, slots=True)
class SchedulingOptions:
    """How a worker presents itself to the scheduler, and orders its own queue."""

    lane: str = setting(
        "any", "prefill only prompts above (long) or below (short) the scheduler's long-prompt "
        "threshold; any: every prompt", choices=LANES, group=SCHEDULING,
    )  # fmt: skip
    waiting_order: str = setting(
        "fcfs", "which waiting prompt the engine admits next: arrival order, or the one with "
        "the fewest tokens to compute (aged by its wait)", choices=WAITING_ORDERS,
        group=SCHEDULING, to="engine",
    )  # fmt: skip
    """The engine's waiting queue (``EngineConfig``)."""
    aging_tokens_per_s: float = setting(
        2000.0, "short_first: a waiting prompt counts this many tokens fewer per second waited",
        group=SCHEDULING, to="engine",
    )  # fmt: skip
    kv_events: bool = setting(
        True, "do not publish prefix-cache changes (KV-aware placement then sees none here)",
        group=SCHEDULING,
    )  # fmt: skip
    duty: str = setting(
        "", "mixed worker: start on prefill or decode duty (default: everything it can); "
        "a planner may move it later", choices=[d for d in DUTIES if d], group=SCHEDULING,
    )  # fmt: skip
    """A mixed worker's duty until a planner orders another (``worker.duty``); empty: any."""
    duty_switch: str = setting(
        "migrate", "mixed worker leaving decode duty: hand its running streams to other "
        "decode workers (the router migrates each, its KV recomputed there), or let them "
        "finish first", choices=DUTY_SWITCHES, group=SCHEDULING,
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.lane not in LANES:
            raise InvalidArgumentError("--lane", f"must be one of {LANES}, got {self.lane!r}")
        if self.waiting_order not in WAITING_ORDERS:
            raise InvalidArgumentError(
                "--waiting-order", f"must be one of {WAITING_ORDERS}, got {self.waiting_order!r}"
            )
        if not self.aging_tokens_per_s > 0:
            raise InvalidArgumentError("--aging-tokens-per-s", "must be > 0")
        if self.duty_switch not in DUTY_SWITCHES:
            raise InvalidArgumentError(
                "--duty-switch", f"must be one of {DUTY_SWITCHES}, got {self.duty_switch!r}"
            )
        if self.duty not in DUTIES:
            raise InvalidArgumentError("--duty", f"must be one of {DUTIES}, got {self.duty!r}")
