"""HostLease: engines on one host take turns on its cores, latency-bound steps first.

Several worker processes on one CPU host (a prefill and a decode worker under ``pdserve up``)
each run an engine whose matmuls use every core. Run at the same time they oversubscribe the
cores: each OpenMP team waits at its barriers for threads the other process has descheduled,
and both run slower than either would alone. A decode step stuck behind a 2K-token prefill
is exactly the stall disaggregation exists to avoid.

So the engines share the cores the way two processes share one GPU: one step at a time, each
with every core. Two kinds of step:

* **interactive** (a decode step, a short prefill): short, on the critical path of a stream.
  It waits for the cores only until the step holding them reaches a checkpoint.
* **bulk** (a long prompt's prefill): long, measured in throughput. Between layers it calls
  ``checkpoint()``; if an interactive step waits, it lends the cores and takes them back
  after that step.

Interactive steps could take every turn and starve bulk work, so while bulk work waits an
engine starts interactive steps at most once per ``interactive_period_s``: a stream's
inter-token gap is bounded by the period plus one bulk stretch between checkpoints, and bulk
work gets the rest of the time. An engine announces its bulk work from its first bulk step
until it runs an interactive step or goes idle (``idle()``), not just while a step waits: the
gap between two bulk steps of a long prompt is no moment for the pacing to lapse.

Mechanism: ``flock`` on three files in one directory shared by the host's workers (kernel
locks: they are released when a process dies, so a killed worker never wedges the others)::

    cores.lock        EX: held by the step that runs now
    interactive.lock  SH: held by each interactive step waiting for the cores
    bulk.lock         SH: held by each engine with bulk work (its bulk steps, and between them)

A bulk step at a checkpoint probes ``interactive.lock`` with a non-blocking EX; when that
fails someone waits: it drops ``cores.lock``, waits (blocking EX, then UN) until every waiter
has the cores and dropped its intent, then takes ``cores.lock`` again, which blocks until the
interactive step ends. An engine thread blocked in ``flock`` holds no GIL.

Torch-free; ``pdserve.engine.gate.ComputeGate`` is the seam the engine calls.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import InvalidArgumentError

CORES, INTERACTIVE, BULK = "cores.lock", "interactive.lock", "bulk.lock"

INTERACTIVE_PERIOD_S = 0.02
"""Default pacing of interactive steps while bulk work waits. A decode stream's gap under a
long prefill is about one period, one decode step and one stretch of bulk work between
checkpoints; at 20 ms that gap stays well inside a 150 ms ITL SLO while the prefill still
gets every stretch between two decode steps (docs/serving.md)."""
BULK_TOKENS = 256
"""Default size above which a step's prompt tokens make it bulk."""


@dataclass(slots=True)
class LeaseStats:
    """Running totals of one process's use of the lease: written by the engine thread,
    read (as plain numbers, a moment stale at worst) by metrics."""

    interactive_steps: int = 0
    bulk_steps: int = 0
    interactive_wait_s: float = 0.0
    """Time interactive steps waited for the cores (the host's other steps, not pacing)."""
    bulk_wait_s: float = 0.0
    paced_s: float = 0.0
    """Time interactive steps were held back so that waiting bulk work could run."""
    yields: int = 0
    """Times a bulk step lent the cores at a checkpoint."""
    lent_s: float = 0.0
    """Time bulk steps spent lent out."""


class HostLease:
    """One process's handle on the host's cores (see the module docstring).

    ``hold(prefill_tokens)`` wraps one engine step: a step that computes more than
    ``bulk_tokens`` prompt tokens is bulk. ``checkpoint()`` is called between layers. Used
    by one step at a time (the engine thread's).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        interactive_period_s: float = INTERACTIVE_PERIOD_S,
        bulk_tokens: int = BULK_TOKENS,
    ) -> None:
        if not interactive_period_s >= 0:
            raise InvalidArgumentError(
                "interactive_period_s", f"must be >= 0, got {interactive_period_s}"
            )
        if bulk_tokens < 0:
            raise InvalidArgumentError("bulk_tokens", f"must be >= 0, got {bulk_tokens}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.interactive_period_s = interactive_period_s
        self.bulk_tokens = bulk_tokens
        self.stats = LeaseStats()
        self._fds = {name: self._open(name) for name in (CORES, INTERACTIVE, BULK)}
        self._holding: bool | None = None  # None: not holding; else whether the step is bulk
        self._announced = False  # this process holds bulk.lock shared
        self._last_interactive = float("-inf")
        self._lock = threading.Lock()  # one step at a time, whatever thread asks

    def _open(self, name: str) -> int:
        return os.open(self.directory / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def close(self) -> None:
        """Close the lock files (drops whatever this process holds)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    # -- the seam ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def hold(self, prefill_tokens: int) -> Iterator[None]:
        """Hold the cores for one step that computes ``prefill_tokens`` prompt tokens."""
        bulk = prefill_tokens > self.bulk_tokens
        with self._lock:
            if bulk:
                self._announce(True)
                started = time.monotonic()
                self._await_no_interactive()
            else:
                self._announce(False)
                self._pace()
                started = time.monotonic()
                self._flock(INTERACTIVE, fcntl.LOCK_SH)
            self._flock(CORES, fcntl.LOCK_EX)
            waited = time.monotonic() - started
            s = self.stats
            if bulk:
                s.bulk_steps += 1
                s.bulk_wait_s += waited
            else:
                self._flock(INTERACTIVE, fcntl.LOCK_UN)
                self._last_interactive = time.monotonic()
                s.interactive_steps += 1
                s.interactive_wait_s += waited
            self._holding = bulk
            try:
                yield
            finally:
                self._holding = None
                self._flock(CORES, fcntl.LOCK_UN)

    def idle(self) -> None:
        """The engine has no work left: it no longer announces bulk work."""
        with self._lock:
            self._announce(False)

    def checkpoint(self) -> None:
        """Between layers of a bulk step: lend the cores to waiting interactive steps."""
        if not self._holding or not self._someone_waits(INTERACTIVE):
            return
        started = time.monotonic()
        self._flock(CORES, fcntl.LOCK_UN)
        self._await_no_interactive()  # every waiter has the cores by now (or gave up)
        self._flock(CORES, fcntl.LOCK_EX)  # blocks until the last of them is done
        self.stats.yields += 1
        self.stats.lent_s += time.monotonic() - started

    # -- helpers -----------------------------------------------------------------------------
    def _announce(self, bulk: bool) -> None:
        if bulk != self._announced:
            self._flock(BULK, fcntl.LOCK_SH if bulk else fcntl.LOCK_UN)
            self._announced = bulk

    def _pace(self) -> None:
        """While bulk work waits, start interactive steps at most once a period."""
        if self.interactive_period_s <= 0:
            return
        due = self._last_interactive + self.interactive_period_s
        wait = due - time.monotonic()
        if wait > 0 and self._someone_waits(BULK):
            self.stats.paced_s += wait
            time.sleep(wait)  # the cores belong to the bulk step meanwhile

    def _await_no_interactive(self) -> None:
        """Block until no interactive step waits for the cores."""
        self._flock(INTERACTIVE, fcntl.LOCK_EX)
        self._flock(INTERACTIVE, fcntl.LOCK_UN)

    def _someone_waits(self, name: str) -> bool:
        """Another process holds ``name`` shared (this one holds it at most exclusively
        for the instant of the probe)."""
        fd = self._fds[name]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def _flock(self, name: str, op: int) -> None:
        fcntl.flock(self._fds[name], op)
