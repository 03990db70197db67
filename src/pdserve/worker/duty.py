"""What a worker serves, and the duty a planner gives a mixed worker.

A worker's *capabilities* follow from how it was started: a prefill worker prefills, a decode
worker decodes, a mixed worker decodes and serves colocated requests, and prefills too when
it has a KV store to hand its KV over through. A planner (``services.planner``) may give a
mixed worker a *duty* by writing it to ``{ns}:duty:{worker_id}``, read with every heartbeat:

* ``prefill``: prefills only;  * ``decode``: decode and colocated requests;
* ``""``: everything it can.

No key means no order: the worker serves its start duty (``--duty``; none: everything it can).
So a cluster started with fixed duties keeps them, and a worker whose order is gone (a
restarted Redis) returns to what it was started as until a planner orders again.

A change of duty drains first: until the engine is idle the worker takes new work only of
the phases both duties share (usually none), so that what it still runs of its old duty
finishes; then it serves the new duty. Nothing is refused meanwhile: the worker keeps
answering every call, and the scheduler simply places no new work of the old duty on it (its
heartbeat says what it serves, and the scheduler re-checks that before committing).

Leaving decode duty, the streams need not run to their end there (``--duty-switch migrate``,
the default): the engine hands them back (``EngineBackend.hand_back``) and the router
migrates each to another decode worker, which recomputes its KV and goes on at the next
token. A drain would hold the worker for the longest stream's remaining tokens, while the
prefill side that asked for it queues or refuses prompts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.scheduling.worker_info import DUTIES, WorkerRole

logger = logging.getLogger(__name__)

_DUTY_PHASES = {"prefill": ("prefill",), "decode": ("decode", "colocated")}


def capabilities(role: WorkerRole, *, can_prefill: bool) -> tuple[str, ...]:
    """The phases a worker started as ``role`` can serve."""
    if role is WorkerRole.PREFILL:
        return ("prefill",)
    if role is WorkerRole.DECODE:
        return ("decode",)
    return ("prefill", "decode", "colocated") if can_prefill else ("decode", "colocated")


class Duty:
    """A worker's duty and whether it is still draining towards it (see the module docstring).

    ``order(value)`` takes what the planner wrote (bytes or None); ``state(idle)`` advances a
    pending change once the engine is idle and returns ``(serves, duty, switching)``.
    """

    def __init__(
        self,
        role: WorkerRole,
        capabilities: tuple[str, ...],
        duty: str = "",
        *,
        hand_back: Callable[[str], None] | None = None,
    ) -> None:
        """``hand_back``: called (with why) when an order takes decode away, so that the
        running streams migrate instead of draining (``EngineBackend.hand_back``); None:
        they drain."""
        self.role = role
        self.hand_back = hand_back
        self.capabilities = capabilities
        self.start = duty
        """The duty it was started with: what it serves while no order is in Redis."""
        self.duty = duty
        self.target = duty
        self.switches = 0
        """Completed changes of duty."""

    def _phases(self, duty: str) -> tuple[str, ...]:
        wanted = _DUTY_PHASES.get(duty, self.capabilities)
        return tuple(p for p in self.capabilities if p in wanted)

    def order(self, value: bytes | str | None) -> None:
        """The planner's order for this worker (None: no order, its start duty)."""
        if value is None:
            duty = self.start
        else:
            duty = value.decode() if isinstance(value, bytes) else value
        if duty == self.target:
            return
        if self.role is not WorkerRole.MIXED or duty not in DUTIES or not self._phases(duty):
            logger.warning("ignoring duty %r: this %s worker cannot serve it", duty, self.role)
            return
        leaves_decode = "decode" in self._phases(self.duty) and "decode" not in self._phases(duty)
        hand_back = self.hand_back if leaves_decode else None
        logger.info(
            "duty %r -> %r: %s first", self.duty, duty, "migrating" if hand_back else "draining"
        )
        self.target = duty
        if hand_back is not None:
            hand_back(f"this worker leaves decode duty for {duty!r}: the stream migrates")

    def state(self, *, idle: bool) -> tuple[tuple[str, ...], str, bool]:
        """``(serves, duty, switching)`` for the next heartbeat."""
        if self.target != self.duty and idle:
            logger.info("duty now %r", self.target or "any")
            self.duty = self.target
            self.switches += 1
        if self.target == self.duty:
            return self._phases(self.duty), self.duty, False
        shared = tuple(p for p in self._phases(self.duty) if p in self._phases(self.target))
        return shared, self.target, True
