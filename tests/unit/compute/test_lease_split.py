"""HostLease with a CoreSplit: bulk and interactive steps run at once on their shares of the
threads, and each engine alone uses every thread. Real flock files; leases in one process
open their own descriptors, so they exclude each other as processes do."""

from __future__ import annotations

import fcntl
import threading
from pathlib import Path

import pytest

from pdserve.compute import CoreSplit, HostLease
from pdserve.compute.lease import WIDE
from pdserve.errors import InvalidArgumentError

BULK_TOKENS = 100
LIVENESS_S = 60.0
"""Bound on waits that only time out when the lease is broken (a hang, not a speed check)."""


class Threads:
    """The counts a lease applied, in order."""

    def __init__(self) -> None:
        self.applied: list[int] = []

    def __call__(self, n: int) -> None:
        self.applied.append(n)


def _lease(directory: Path, threads: Threads, interactive: int = 1) -> HostLease:
    split = CoreSplit(threads=4, interactive=interactive, set_threads=threads)
    return HostLease(directory, bulk_tokens=BULK_TOKENS, split=split)


def test_an_engine_alone_uses_every_thread(tmp_path: Path) -> None:
    threads = Threads()
    lease = _lease(tmp_path, threads)
    with lease.hold(BULK_TOKENS + 1):
        lease.checkpoint()
    with lease.hold(0, 1):
        pass
    assert threads.applied == [4]  # set once: both kinds of step ran alone
    assert lease.stats.splits == 0


def test_interactive_step_runs_beside_a_bulk_step_that_never_checkpoints(tmp_path: Path) -> None:
    bulk_threads, decode_threads = Threads(), Threads()
    bulk, decode = _lease(tmp_path, bulk_threads, 1), _lease(tmp_path, decode_threads, 1)
    with decode.hold(0, 1):  # streams are announced from the first interactive step on
        pass
    with bulk.hold(BULK_TOKENS + 1):
        assert bulk_threads.applied == [3]  # started on its share: streams were announced
        done = threading.Event()

        def step() -> None:
            with decode.hold(0, 1):
                done.set()

        t = threading.Thread(target=step)
        t.start()
        assert done.wait(LIVENESS_S), "the interactive step waited for the bulk step"
        t.join(LIVENESS_S)
    assert decode_threads.applied == [4, 1]  # alone, then beside announced bulk work
    assert bulk.stats.splits == 1 and bulk.stats.yields == 0


def test_a_full_bulk_step_gives_its_share_away_at_a_checkpoint(tmp_path: Path) -> None:
    bulk_threads, decode_threads = Threads(), Threads()
    bulk, decode = _lease(tmp_path, bulk_threads), _lease(tmp_path, decode_threads)
    ran, release = threading.Event(), threading.Event()

    def step() -> None:
        with decode.hold(0, 1):
            ran.set()
            assert release.wait(LIVENESS_S)

    with bulk.hold(BULK_TOKENS + 1):
        assert bulk_threads.applied == [4]  # nothing else on the host: every thread
        t = threading.Thread(target=step)
        t.start()
        while not ran.is_set():
            bulk.checkpoint()  # the interactive step waits: the bulk step splits
        # The bulk step goes on beside the running interactive step, not after it.
        bulk.checkpoint()
        assert bulk_threads.applied == [4, 3]
        release.set()
        t.join(LIVENESS_S)
        decode.idle()  # the streams are done: the next checkpoint takes every thread back
        bulk.checkpoint()
        assert bulk_threads.applied == [4, 3, 4]
    assert decode_threads.applied == [1]


def test_bulk_steps_still_go_one_at_a_time(tmp_path: Path) -> None:
    log: list[str] = []
    guard = threading.Lock()
    leases = [_lease(tmp_path, Threads()) for _ in range(3)]
    decode = _lease(tmp_path, Threads())
    with decode.hold(0, 1):  # streams stay announced after it: every bulk step below splits
        pass

    def run(name: str, lease: HostLease) -> None:
        for _ in range(20):
            with lease.hold(BULK_TOKENS + 1):
                with guard:
                    log.append(f"enter:{name}")
                lease.checkpoint()
                with guard:
                    log.append(f"exit:{name}")

    threads = [threading.Thread(target=run, args=(str(i), le)) for i, le in enumerate(leases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIVENESS_S)
    assert all(le.stats.splits == 20 for le in leases)
    assert len(log) == 3 * 20 * 2
    for enter, leave in zip(log[::2], log[1::2], strict=True):
        assert leave == "exit:" + enter.removeprefix("enter:")


@pytest.mark.parametrize(
    ("threads", "interactive", "field"),
    [(1, 1, "threads"), (4, 0, "interactive"), (4, 4, "interactive")],
)
def test_bad_splits_name_the_field(threads: int, interactive: int, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        CoreSplit(threads=threads, interactive=interactive, set_threads=Threads())


def test_a_short_prompt_only_step_runs_beside_decode_steps(tmp_path: Path) -> None:
    """It stalls no stream of its own: bulk under a split, interactive when taking turns."""
    prefill_threads, decode_threads = Threads(), Threads()
    prefill, decode = _lease(tmp_path, prefill_threads), _lease(tmp_path, decode_threads)
    with decode.hold(0, 1):
        pass
    with prefill.hold(BULK_TOKENS // 2):
        assert prefill_threads.applied == [3]
    assert prefill.stats.bulk_steps == 1 and prefill.stats.interactive_steps == 0
    with prefill.hold(BULK_TOKENS // 2, 1):  # with a stream of its own: interactive
        pass
    assert prefill.stats.interactive_steps == 1
    turns = HostLease(tmp_path / "turns", bulk_tokens=BULK_TOKENS)
    with turns.hold(BULK_TOKENS // 2):
        pass
    assert turns.stats.interactive_steps == 1


def test_two_engines_with_streams_step_side_by_side(tmp_path: Path) -> None:
    """No bulk work: the second engine's step runs on the bulk share beside the first's,
    once a step that took every thread has ended; the first then keeps to its share."""
    a_threads, b_threads = Threads(), Threads()
    a, b = _lease(tmp_path, a_threads), _lease(tmp_path, b_threads)
    inside, release, done = threading.Event(), threading.Event(), threading.Event()

    def b_step() -> None:
        with b.hold(0, 1):
            inside.set()
            assert release.wait(LIVENESS_S)
        done.set()

    t = threading.Thread(target=b_step)
    beside = threading.Event()  # b has the bulk share and waits for a's wide step to end
    flock = b._flock

    def spy(name: str, op: int) -> None:
        if name == WIDE and op == fcntl.LOCK_EX:
            beside.set()
        flock(name, op)

    b._flock = spy
    with a.hold(0, 1):  # alone: every thread
        t.start()  # finds the cores taken
        assert beside.wait(LIVENESS_S)
    assert inside.wait(LIVENESS_S)
    assert b_threads.applied == [3]
    with a.hold(0, 1):  # beside b's running step, on its share
        assert not done.is_set()
    assert a_threads.applied == [4, 1]
    release.set()
    t.join(LIVENESS_S)
    assert done.is_set()
