"""HostLease: engines on one host share its cores, latency-bound steps first.

Several worker processes on one CPU host (a prefill and a decode worker under ``pdserve up``)
each run an engine whose matmuls use every core. Run at the same time they oversubscribe the
cores: each OpenMP team waits at its barriers for threads the other process has descheduled,
and both run slower than either would alone. A decode step stuck behind a 2K-token prefill
is exactly the stall disaggregation exists to avoid.

**Taking turns** (engines without a split): the engines share the cores the way two
processes share one GPU, one step at a time, each with every core. Two kinds of step:

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

**Split** (``CoreSplit``, engines with threads to split): taking turns still costs a stream
one bulk stretch plus one pacing period per token, several times its step alone. So when
bulk and interactive work run at once, the lease splits the threads instead: interactive
steps keep ``split.interactive`` threads, the bulk step runs beside them on the rest, and
neither waits for the other. Each engine uses every thread while it is alone (work
conserving): a bulk step takes all of them, and ``cores.lock``, while no engine announces
streams, and gives back its interactive share at the next checkpoint once one does. Three
more files::

    streams.lock   SH: held by each engine with interactive work (its interactive steps,
                   and between them until it goes idle)
    bulk-run.lock  EX: held by the step on the bulk share: a bulk step (they still go one at
                   a time), or an interactive step while no bulk work is announced
    wide.lock      SH: held by an interactive step on every thread

Two engines with streams (two mixed workers) run side by side the same way: while no bulk
work is announced, an interactive step that finds ``cores.lock`` taken runs on the bulk
share instead of waiting. It takes ``bulk-run.lock`` before it looks at ``wide.lock``, and a
step on every thread takes ``wide.lock`` before it looks at ``bulk-run.lock`` (and keeps to
its share if taken): whichever comes second sees the first, so two steps never run on more
threads than the host has.

An interactive step takes ``cores.lock`` before it reads whether bulk work is announced, and
a bulk step announces before it waits once for ``cores.lock``: so a step that started on
every thread ends before a bulk step starts beside it.

Torch-free; ``pdserve.engine.gate.ComputeGate`` is the seam the engine calls.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from pdserve.errors import InvalidArgumentError

CORES, INTERACTIVE, BULK = "cores.lock", "interactive.lock", "bulk.lock"
STREAMS, BULK_RUN, WIDE = "streams.lock", "bulk-run.lock", "wide.lock"

INTERACTIVE_PERIOD_S = 0.02
"""Default pacing of interactive steps while bulk work waits. A decode stream's gap under a
long prefill is about one period, one decode step and one stretch of bulk work between
checkpoints; at 20 ms that gap stays well inside a 150 ms ITL SLO while the prefill still
gets every stretch between two decode steps (docs/serving.md)."""
BULK_TOKENS = 256
"""Default size above which a step's prompt tokens make it bulk."""


def interactive_threads(threads: int, keep: int | None = None) -> int:
    """The threads interactive steps keep under a split of ``threads``: ``keep``
    (``--lease-split-threads``; 0: no split), or half of them when None."""
    return threads // 2 if keep is None else keep


@dataclass(frozen=True, slots=True)
class CoreSplit:
    """How an engine's threads are split while bulk and interactive steps run at once."""

    threads: int
    """Every thread the engine has: what a step alone on the host uses."""
    interactive: int
    """What interactive steps keep while bulk work runs beside them; the bulk step gets the
    rest."""
    set_threads: Callable[[int], None]
    """Applies a thread count to the calling thread (the engine's: the one that runs steps)."""

    def __post_init__(self) -> None:
        if self.threads < 2:
            raise InvalidArgumentError("threads", f"a split needs >= 2 threads, got {self.threads}")
        if not 1 <= self.interactive < self.threads:
            raise InvalidArgumentError(
                "interactive", f"must be in [1, {self.threads - 1}], got {self.interactive}"
            )

    @property
    def bulk(self) -> int:
        return self.threads - self.interactive


class _Hold(Enum):
    INTERACTIVE = "interactive"
    """An interactive step holding ``cores.lock``."""
    INTERACTIVE_BESIDE = "interactive_beside"
    """An interactive step on the bulk share (``bulk-run.lock``) beside another one."""
    BULK = "bulk"
    """A bulk step on every thread, holding ``cores.lock``."""
    BULK_SPLIT = "bulk_split"
    """A bulk step on its share of a split, beside interactive steps."""


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
    splits: int = 0
    """Times a bulk step went onto its share of a split (at its start or at a checkpoint)."""


class HostLease:
    """One process's handle on the host's cores (see the module docstring).

    ``hold(prefill_tokens, decodes)`` wraps one engine step: a step that computes more than
    ``bulk_tokens`` prompt tokens is bulk (with a split, so is one that decodes no stream).
    ``checkpoint()`` is called between layers. Used by one step at a time (the engine
    thread's). With ``split`` the lease splits the threads while bulk and interactive work
    overlap; without, the steps take turns.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        interactive_period_s: float = INTERACTIVE_PERIOD_S,
        bulk_tokens: int = BULK_TOKENS,
        split: CoreSplit | None = None,
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
        self.split = split
        self.stats = LeaseStats()
        names = (CORES, INTERACTIVE, BULK, STREAMS, BULK_RUN, WIDE)
        self._fds = {name: self._open(name) for name in names}
        self._holding: _Hold | None = None
        self._announced: str | None = None  # BULK or STREAMS: which this process holds shared
        self._threads = 0  # the count last applied through the split
        self._wide = False  # this process holds wide.lock shared
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
    def hold(self, prefill_tokens: int, decodes: int = 0) -> Iterator[None]:
        """Hold the cores for one step that computes ``prefill_tokens`` prompt tokens and
        the next token of ``decodes`` streams. With a split, a step that decodes no stream is
        bulk whatever its size: it stalls no stream, so it runs beside the decode steps."""
        bulk = prefill_tokens > self.bulk_tokens or (
            self.split is not None and prefill_tokens > 0 and decodes == 0
        )
        with self._lock:
            started = time.monotonic()
            self._holding = self._take_bulk() if bulk else self._take_interactive()
            waited = time.monotonic() - started
            s = self.stats
            if bulk:
                s.bulk_steps += 1
                s.bulk_wait_s += waited
            else:
                self._last_interactive = time.monotonic()
                s.interactive_steps += 1
                s.interactive_wait_s += waited
            try:
                yield
            finally:
                held = self._holding
                if held is _Hold.INTERACTIVE or held is _Hold.BULK:
                    self._flock(CORES, fcntl.LOCK_UN)
                if self.split is not None and held is not _Hold.INTERACTIVE:
                    self._flock(BULK_RUN, fcntl.LOCK_UN)
                if self._wide:
                    self._flock(WIDE, fcntl.LOCK_UN)
                    self._wide = False
                self._holding = None

    def idle(self) -> None:
        """The engine has no work left: it no longer announces bulk work or streams."""
        with self._lock:
            self._announce(None)

    def checkpoint(self) -> None:
        """Between layers of a bulk step: lend the cores to waiting interactive steps, or (with
        a split) run beside them on the bulk share, back on every thread once they are gone."""
        if self._holding is _Hold.BULK_SPLIT:
            if not self._someone_waits(STREAMS) and self._try(CORES):
                assert self.split is not None  # a split hold needs one
                self._use_threads(self.split.threads)
                self._holding = _Hold.BULK
            return
        if self._holding is not _Hold.BULK or not self._someone_waits(INTERACTIVE):
            return
        if self.split is not None:
            self._go_split()
            return
        started = time.monotonic()
        self._flock(CORES, fcntl.LOCK_UN)
        self._await_no_interactive()  # every waiter has the cores by now (or gave up)
        self._flock(CORES, fcntl.LOCK_EX)  # blocks until the last of them is done
        self.stats.yields += 1
        self.stats.lent_s += time.monotonic() - started

    # -- helpers -----------------------------------------------------------------------------
    def _take_bulk(self) -> _Hold:
        self._announce(BULK)
        if self.split is None:
            self._await_no_interactive()
            self._flock(CORES, fcntl.LOCK_EX)
            return _Hold.BULK
        self._flock(BULK_RUN, fcntl.LOCK_EX)
        if self._someone_waits(STREAMS):
            # Announced before this wait: a step that started on every thread ends first, and
            # every later one starts on its share.
            self._flock(CORES, fcntl.LOCK_EX)
            self._flock(CORES, fcntl.LOCK_UN)
            self._use_threads(self.split.bulk)
            self.stats.splits += 1
            return _Hold.BULK_SPLIT
        self._await_no_interactive()
        self._flock(CORES, fcntl.LOCK_EX)
        self._use_threads(self.split.threads)
        return _Hold.BULK

    def _take_interactive(self) -> _Hold:
        split = self.split
        if split is None:
            self._announce(None)
            self._pace()
            self._wait_for_cores()
            return _Hold.INTERACTIVE
        self._announce(STREAMS)
        if not self._try(CORES):
            beside = self._beside_interactive(split)
            if beside is not None:
                return beside
            self._wait_for_cores()
        # Read after taking the cores (module docstring).
        self._use_threads(split.interactive if self._shared(split) else split.threads)
        return _Hold.INTERACTIVE

    def _wait_for_cores(self) -> None:
        """Block for ``cores.lock``, saying so on ``interactive.lock`` meanwhile (a bulk step
        at a checkpoint lends, or splits, when it sees a waiter)."""
        self._flock(INTERACTIVE, fcntl.LOCK_SH)
        self._flock(CORES, fcntl.LOCK_EX)
        self._flock(INTERACTIVE, fcntl.LOCK_UN)

    def _beside_interactive(self, split: CoreSplit) -> _Hold | None:
        """Another interactive step holds the cores: run beside it on the bulk share, if no
        bulk work is announced and that share is free; None to wait for the cores instead."""
        if self._someone_waits(BULK) or not self._try(BULK_RUN):
            return None
        self._flock(WIDE, fcntl.LOCK_EX)  # a step on every thread ends first (docstring)
        self._flock(WIDE, fcntl.LOCK_UN)
        self._use_threads(split.bulk)
        return _Hold.INTERACTIVE_BESIDE

    def _shared(self, split: CoreSplit) -> bool:
        """Whether this interactive step (holding the cores) keeps to its share: bulk work is
        announced, or a step runs on the bulk share. Otherwise it takes every thread and
        ``wide.lock``, taken before the look (module docstring)."""
        if self._someone_waits(BULK):
            return True
        self._flock(WIDE, fcntl.LOCK_SH)
        if self._try(BULK_RUN):
            self._flock(BULK_RUN, fcntl.LOCK_UN)
            self._wide = True
            return False
        self._flock(WIDE, fcntl.LOCK_UN)
        return True

    def _go_split(self) -> None:
        """From every thread to the bulk share: the interactive steps get the cores."""
        assert self.split is not None
        self._use_threads(self.split.bulk)
        self._flock(CORES, fcntl.LOCK_UN)
        self._holding = _Hold.BULK_SPLIT
        self.stats.splits += 1

    def _use_threads(self, n: int) -> None:
        if self.split is not None and n != self._threads:
            self.split.set_threads(n)
            self._threads = n

    def _announce(self, kind: str | None) -> None:
        if kind != self._announced:
            if self._announced is not None:
                self._flock(self._announced, fcntl.LOCK_UN)
            if kind is not None:
                self._flock(kind, fcntl.LOCK_SH)
            self._announced = kind

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
        if not self._try(name):
            return True
        fcntl.flock(self._fds[name], fcntl.LOCK_UN)
        return False

    def _try(self, name: str) -> bool:
        """Take ``name`` exclusively if nobody holds it."""
        try:
            fcntl.flock(self._fds[name], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _flock(self, name: str, op: int) -> None:
        fcntl.flock(self._fds[name], op)
