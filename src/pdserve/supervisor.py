"""Keeps a local cluster's processes running: a dead service is restarted, the rest serve on.

``Supervisor`` watches the children of a ``launcher.Cluster`` (and its embedded Redis) as a
process manager would. A service that exits is started again on the **same port**, so every
address handed out stays valid (the router's ``--scheduler``, the workers' ``--kvstore``,
Redis URLs, the router's port for clients), after a backoff that doubles with each restart in
a row (``RestartPolicy``; a run that lasted ``stable_after_s`` starts the count over). A service
that exits more than ``crash_loop_restarts`` times within ``crash_loop_window_s`` is given up,
loudly: it is left down, and the cluster is marked ``fatal`` unless it was a worker with a
live peer of its role (a spare that still serves).

What the others do meanwhile (see docs/reliability.md): workers keep beating into a Redis that
came back (and re-register), routers reconnect to a restarted scheduler, workers to a restarted
KV store; a restarted prefill worker's janitor unlinks the shm segments its predecessor left.

Threading: ``run`` loops in a thread of its own (``Cluster.start`` starts it). The children it
restarts ask the kernel for SIGTERM when *that thread* ends (``PR_SET_PDEATHSIG`` follows the
thread), so the thread lives until ``finish``, after the cluster has stopped its services in
order; ``halt`` first stops the restarts so that none races the shutdown.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.errors import InvalidArgumentError, WorkerUnavailableError
from pdserve.redis_server import EmbeddedRedis
from pdserve.service_process import ServiceProcess

logger = logging.getLogger(__name__)

REDIS = "redis"
"""The name the embedded Redis goes by in the supervisor's messages and counts."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When to restart a service that exited, and when to stop trying."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    multiplier: float = 2.0
    stable_after_s: float = 30.0
    """A run at least this long was a success: the next exit restarts after the first delay."""
    crash_loop_restarts: int = 5
    """Exits tolerated within ``crash_loop_window_s``; one more gives the service up."""
    crash_loop_window_s: float = 60.0
    poll_s: float = 0.1
    """How often children are checked (they offer nothing to block on)."""

    def __post_init__(self) -> None:
        for name in ("initial_backoff_s", "max_backoff_s", "crash_loop_window_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(name, f"must be > 0, got {getattr(self, name)}")
        if not self.multiplier >= 1:
            raise InvalidArgumentError("multiplier", f"must be >= 1, got {self.multiplier}")
        if self.crash_loop_restarts < 0:
            raise InvalidArgumentError(
                "crash_loop_restarts", f"must be >= 0, got {self.crash_loop_restarts}"
            )

    def backoff_s(self, in_a_row: int) -> float:
        """The delay before restart number ``in_a_row`` (1 for the first) of a failing run."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (in_a_row - 1))


@dataclass(slots=True)
class ServiceRecord:
    """What the supervisor knows of one service's exits and restarts."""

    name: str
    started_at: float
    exits: deque[float] = field(default_factory=deque)
    """Exit times within the crash-loop window (monotonic seconds)."""
    in_a_row: int = 0
    """Restarts since the last stable run."""
    restart_at: float | None = None
    """When the pending restart is due; None while the service runs."""
    restarts: int = 0
    given_up: bool = False


class Supervisor:
    """Restarts the services of one cluster and its embedded Redis (see the module doc).

    ``env`` is what every service starts with; ``redis`` the cluster's own Redis, None when it
    uses an external one (not ours to restart). ``announce`` hears every exit, restart and
    give-up as one line (default: the log).
    """

    def __init__(
        self,
        services: Sequence[ServiceProcess],
        env: Mapping[str, str],
        *,
        redis: EmbeddedRedis | None = None,
        policy: RestartPolicy | None = None,
        announce: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.services = list(services)
        self.env = dict(env)
        self.redis = redis
        self.policy = policy or RestartPolicy()
        self.announce = announce or logger.warning
        self.clock = clock
        now = clock()
        names = [s.name for s in self.services] + ([REDIS] if redis is not None else [])
        self.records = {name: ServiceRecord(name, now) for name in names}
        self.fatal = threading.Event()
        """Set when a service the cluster cannot do without was given up."""
        self._lock = threading.Lock()  # one tick at a time; halt() waits for the current one
        self._halted = threading.Event()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the thread ------------------------------------------------------------------------------

    def start(self) -> None:
        """Supervise from a thread of its own until ``halt``; it lives on until ``finish``."""
        if self._thread is not None:
            raise RuntimeError("Supervisor already started")
        self._thread = threading.Thread(target=self.run, name="pdserve-supervisor", daemon=True)
        self._thread.start()

    def run(self) -> None:
        while not self._halted.wait(self.policy.poll_s):
            with self._lock:
                if not self._halted.is_set():
                    self.tick()
        # The children this thread restarted die with it (PR_SET_PDEATHSIG): stay until the
        # cluster has stopped them in order.
        self._finished.wait()

    def halt(self) -> None:
        """Stop restarting; returns once no restart is under way."""
        self._halted.set()
        with self._lock:
            pass

    def finish(self) -> None:
        """End the thread (after ``halt`` and the services' shutdown)."""
        self.halt()
        self._finished.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # -- one round -------------------------------------------------------------------------------

    def restarts(self, name: str) -> int:
        """How often ``name`` was restarted so far."""
        return self.records[name].restarts

    def given_up(self) -> list[str]:
        return [r.name for r in self.records.values() if r.given_up]

    def tick(self) -> None:
        """Notice exits, and restart what is due."""
        now = self.clock()
        for service in self.services:
            self._check(self.records[service.name], now, _exit_status(service), service)
        if self.redis is not None:
            status = None if self.redis.running else "exited"
            self._check(self.records[REDIS], now, status, None)

    def _check(
        self, record: ServiceRecord, now: float, status: str | None, service: ServiceProcess | None
    ) -> None:
        if record.given_up:
            return
        if record.restart_at is None:
            if status is not None:
                self._exited(record, now, status, service)
            return
        if now >= record.restart_at:
            self._restart(record, now, service)

    def _exited(
        self, record: ServiceRecord, now: float, status: str, service: ServiceProcess | None
    ) -> None:
        p = self.policy
        if now - record.started_at >= p.stable_after_s:
            record.in_a_row = 0
        record.exits.append(now)
        while record.exits and record.exits[0] < now - p.crash_loop_window_s:
            record.exits.popleft()
        tail = f"\n{service.log_tail(10)}" if service is not None else ""
        if len(record.exits) > p.crash_loop_restarts:
            record.given_up = True
            essential = service is None or not self._has_live_peer(service)
            self.announce(
                f"{record.name} {status} {len(record.exits)} times within "
                f"{p.crash_loop_window_s:g} s: giving up on it"
                + ("; the cluster cannot serve without it" if essential else "")
                + tail
            )
            if essential:
                self.fatal.set()
            return
        record.in_a_row += 1
        delay = p.backoff_s(record.in_a_row)
        record.restart_at = now + delay
        self.announce(f"{record.name} {status}; restarting it in {delay:.3g} s{tail}")

    def _restart(self, record: ServiceRecord, now: float, service: ServiceProcess | None) -> None:
        record.restart_at = None
        record.started_at = now
        try:
            if service is None:
                assert self.redis is not None  # only Redis goes without a ServiceProcess
                self.redis.stop()  # reaps the dead process, drops its directory
                self.redis.start()  # the same port: every URL handed out stays valid
            else:
                service.spawn(self.env, port=service.port or 0)
        except (OSError, WorkerUnavailableError) as err:
            # Counted like any other exit: backoff, and in the end the crash-loop limit.
            self._exited(record, now, f"failed to start ({err})", service)
            return
        record.restarts += 1
        self.announce(f"{record.name} restarted (restart {record.restarts})")

    def _has_live_peer(self, service: ServiceProcess) -> bool:
        if service.role is None:
            return False
        return any(
            s is not service and s.role == service.role and not self.records[s.name].given_up
            for s in self.services
        )


def _exit_status(service: ServiceProcess) -> str | None:
    """None while the service runs, else how it ended ("exited with status 1", ...)."""
    proc = service.proc
    if proc is None or proc.poll() is None:
        return None
    code = proc.returncode
    return f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
