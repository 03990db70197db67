"""HostLease between real processes on real flock files: exclusion, priority, pacing, death."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path

import pytest

from pdserve.compute import HostLease
from pdserve.compute.lease import BULK as BULK_LOCK
from pdserve.errors import InvalidArgumentError

CTX = mp.get_context("fork")
BULK_TOKENS = 100
LIVENESS_S = 60.0
"""Bound on waits that only time out when the lease is broken (a hang, not a speed check)."""


def _log(path: Path, line: str) -> None:
    with open(path, "a") as f:  # O_APPEND: whole lines, in the order written
        f.write(line + "\n")


def _lines(path: Path) -> list[str]:
    return path.read_text().split()


def _exclusive_worker(directory: Path, log: Path, name: str, bulk: bool, rounds: int) -> None:
    lease = HostLease(directory, interactive_period_s=0.0, bulk_tokens=BULK_TOKENS)
    for _ in range(rounds):
        with lease.hold(BULK_TOKENS + 1 if bulk else 1):
            _log(log, f"enter:{name}")
            _log(log, f"exit:{name}")
            lease.checkpoint()  # the cores may go to another step here, not between the lines


def test_one_step_at_a_time(tmp_path: Path) -> None:
    log = tmp_path / "log"
    procs = [
        CTX.Process(target=_exclusive_worker, args=(tmp_path / "lease", log, n, n == "b", 30))
        for n in ("a", "b", "c")
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(LIVENESS_S)
        assert p.exitcode == 0
    lines = _lines(log)
    assert len(lines) == 3 * 30 * 2
    for enter, leave in zip(lines[::2], lines[1::2], strict=True):
        assert enter.startswith("enter:")
        assert leave == "exit:" + enter.removeprefix("enter:")  # nobody entered in between


def _bulk_until(directory: Path, log: Path, started: mp.Event, stop: mp.Event) -> None:
    lease = HostLease(directory, bulk_tokens=BULK_TOKENS)
    with lease.hold(BULK_TOKENS + 1):
        _log(log, "bulk-start")
        started.set()
        while not stop.is_set():  # a long prompt's layers, each ending in a checkpoint
            lease.checkpoint()
        _log(log, "bulk-end")
    assert lease.stats.yields >= 1


def test_interactive_step_runs_inside_a_bulk_step(tmp_path: Path) -> None:
    """A bulk step that never ends lends the cores at a checkpoint: the interactive step
    completes while the bulk step is still running."""
    directory, log = tmp_path / "lease", tmp_path / "log"
    started, stop = CTX.Event(), CTX.Event()
    bulk = CTX.Process(target=_bulk_until, args=(directory, log, started, stop))
    bulk.start()
    assert started.wait(LIVENESS_S)
    lease = HostLease(directory, bulk_tokens=BULK_TOKENS)
    with lease.hold(1):
        _log(log, "interactive")
    stop.set()
    bulk.join(LIVENESS_S)
    assert bulk.exitcode == 0
    assert _lines(log) == ["bulk-start", "interactive", "bulk-end"]


def _bulk_steps(directory: Path, log: Path, started: mp.Event, stop: mp.Event) -> None:
    lease = HostLease(directory, bulk_tokens=BULK_TOKENS)
    while not stop.is_set():  # a long prompt's prefill, step after step
        with lease.hold(BULK_TOKENS + 1):
            _log(log, "bulk")
            started.set()
    lease.idle()


def test_waiting_bulk_work_runs_between_paced_interactive_steps(tmp_path: Path) -> None:
    directory, log = tmp_path / "lease", tmp_path / "log"
    started, stop = CTX.Event(), CTX.Event()
    bulk = CTX.Process(target=_bulk_steps, args=(directory, log, started, stop))
    bulk.start()
    assert started.wait(LIVENESS_S)
    lease = HostLease(directory, interactive_period_s=0.5, bulk_tokens=BULK_TOKENS)
    for _ in range(3):
        with lease.hold(1):
            _log(log, "interactive")
    stop.set()
    bulk.join(LIVENESS_S)
    lines = _lines(log)
    first = lines.index("interactive")
    # The bulk engine announces its work between its steps too, so every interactive step
    # after the first was paced, and the cores went to the bulk work meanwhile.
    assert lease.stats.paced_s > 0
    runs = " ".join(lines[first:]).split("interactive")[1:-1]
    assert any("bulk" in run for run in runs), "bulk work waited through every pacing period"


def test_idle_ends_the_bulk_announcement(tmp_path: Path) -> None:
    directory = tmp_path / "lease"
    bulk, other = HostLease(directory, bulk_tokens=BULK_TOKENS), HostLease(directory)
    with bulk.hold(BULK_TOKENS + 1):
        pass
    assert other._someone_waits(BULK_LOCK)  # still announced between bulk steps
    bulk.idle()
    assert not other._someone_waits(BULK_LOCK)
    with bulk.hold(BULK_TOKENS + 1):
        pass
    with bulk.hold(0):  # an interactive step of its own ends it too
        pass
    assert not other._someone_waits(BULK_LOCK)


def _hold_forever(directory: Path, holding: mp.Event) -> None:
    lease = HostLease(directory)
    with lease.hold(1):
        holding.set()
        threading.Event().wait()  # until killed


def test_a_killed_holder_releases_the_cores(tmp_path: Path) -> None:
    directory = tmp_path / "lease"
    holding = CTX.Event()
    holder = CTX.Process(target=_hold_forever, args=(directory, holding))
    holder.start()
    assert holding.wait(LIVENESS_S)
    assert holder.pid is not None
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(LIVENESS_S)
    got = threading.Event()

    def take() -> None:
        with HostLease(directory).hold(1):
            got.set()

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    assert got.wait(LIVENESS_S), "the dead holder's lock outlived it"


def test_checkpoint_outside_a_bulk_step_does_nothing(tmp_path: Path) -> None:
    lease = HostLease(tmp_path, bulk_tokens=BULK_TOKENS)
    lease.checkpoint()
    with lease.hold(1):
        lease.checkpoint()
    assert lease.stats.yields == 0
    assert (lease.stats.interactive_steps, lease.stats.bulk_steps) == (1, 0)


def test_stats_count_each_kind_of_step(tmp_path: Path) -> None:
    lease = HostLease(tmp_path, bulk_tokens=BULK_TOKENS)
    with lease.hold(BULK_TOKENS + 1):
        pass
    for _ in range(2):
        with lease.hold(BULK_TOKENS):
            pass
    s = lease.stats
    assert (s.bulk_steps, s.interactive_steps) == (1, 2)
    assert s.bulk_wait_s >= 0 and s.interactive_wait_s >= 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"interactive_period_s": -1.0}, "interactive_period_s"),
        ({"bulk_tokens": -1}, "bulk_tokens"),
    ],
)
def test_bad_settings_name_the_field(tmp_path: Path, kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        HostLease(tmp_path, **kwargs)  # type: ignore[arg-type]
