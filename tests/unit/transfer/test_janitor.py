"""reclaim_orphans: dead owners' and expired segments go, live owners' stay."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from pdserve.transfer.janitor import (
    SHM_DIR,
    ReclaimReason,
    SegmentState,
    owner_alive,
    parse_owner_pid,
    process_start_time,
    reclaim_orphans,
    segment_name,
    segment_state,
)
from pdserve.transfer.shm.writer import SegmentWriter
from tests.unit.transfer.conftest import leftovers, make_layout, random_payload
from tests.unit.transfer.shm._shm_child import hand_off_and_hang


def test_killed_owner_is_reclaimed_live_owner_kept(shm_prefix: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=hand_off_and_hang, args=(shm_prefix, child_end), daemon=True)
    child.start()
    try:
        assert parent_end.poll(60), "child never reported its segment"
        orphan = parent_end.recv()
        assert child.pid is not None and parse_owner_pid(orphan, shm_prefix) == child.pid
        # Ours, alive: kept however old, as is the child's while it lives.
        mine = SegmentWriter(prefix=shm_prefix)
        mine.begin("mine", make_layout(), 4)
        assert reclaim_orphans(shm_prefix, max_age_s=None) == []
        assert leftovers(shm_prefix) == sorted([orphan, mine.name])

        os.kill(child.pid, signal.SIGKILL)
        child.join(30)  # reaped: its pid no longer exists
        assert child.exitcode == -signal.SIGKILL
        removed = reclaim_orphans(shm_prefix, max_age_s=None)
        assert [(r.name, r.owner_pid, r.reason) for r in removed] == [
            (orphan, child.pid, ReclaimReason.OWNER_DEAD)
        ]
        assert removed[0].num_bytes > 0
        assert leftovers(shm_prefix) == [mine.name]
        mine.abort()
    finally:
        if child.is_alive():
            child.kill()
            child.join(30)


def _sealed(prefix: str, request_id: str) -> str:
    payload = random_payload(make_layout(num_layers=2), 4)
    sender = SegmentWriter(prefix=prefix)
    sender.begin(request_id, payload.layout, 4)
    for i in range(2):
        sender.send_layer(i, payload.keys[i], payload.values[i])
    return sender.finish().key


def _age(name: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(SHM_DIR / name, (then, then))


def test_sealed_segment_of_a_live_owner_expires_from_its_seal(shm_prefix: str) -> None:
    # An hour on (``now``): aging the file instead would date it before this process began,
    # which is what a recycled pid looks like (below).
    old = _sealed(shm_prefix, "old")
    new = _sealed(shm_prefix, "new")
    hour_on = time.time() + 3600
    os.utime(SHM_DIR / new, (hour_on, hour_on))
    removed = reclaim_orphans(shm_prefix, max_age_s=600, now=hour_on)
    assert [(r.name, r.reason) for r in removed] == [(old, ReclaimReason.EXPIRED)]
    assert removed[0].age_s >= 3600
    assert leftovers(shm_prefix) == [new]
    (SHM_DIR / new).unlink()


def test_segment_being_written_is_kept_however_long_its_prefill_takes(shm_prefix: str) -> None:
    # A 32K-token prefill on a CPU keeps its segment unsealed for many minutes.
    payload = random_payload(make_layout(num_layers=2), 4)
    sender = SegmentWriter(prefix=shm_prefix)
    sender.begin("long", payload.layout, 4)
    sender.send_layer(0, payload.keys[0], payload.values[0])
    hour_on = time.time() + 3600
    assert reclaim_orphans(shm_prefix, max_age_s=600, now=hour_on) == []
    assert segment_state(SHM_DIR / sender.name) == SegmentState.WRITING
    _age(sender.name, 60)  # the reservation, a minute ago
    sender.send_layer(1, payload.keys[1], payload.values[1])
    name = sender.finish().key
    # Sealing restarted the clock: the hand-off is fresh, so its reader finds it.
    assert segment_state(SHM_DIR / name) == SegmentState.SEALED
    assert time.time() - (SHM_DIR / name).stat().st_mtime < 30
    assert reclaim_orphans(shm_prefix, max_age_s=40) == []
    (SHM_DIR / name).unlink()


@pytest.mark.skipif(process_start_time(os.getpid()) is None, reason="needs Linux /proc")
def test_recycled_pid_counts_as_dead(shm_prefix: str) -> None:
    # This process's pid on a segment last changed before this process started: the pid was
    # reused, the segment's writer is gone.
    name = _sealed(shm_prefix, "recycled")
    started = process_start_time(os.getpid())
    assert started is not None and started <= time.time()
    then = started - 3600
    os.utime(SHM_DIR / name, (then, then))
    assert not owner_alive(os.getpid(), since=then)
    removed = reclaim_orphans(shm_prefix, max_age_s=None)
    assert [(r.name, r.reason) for r in removed] == [(name, ReclaimReason.OWNER_DEAD)]


def test_other_files_untouched_and_odd_names_expire_only(shm_prefix: str) -> None:
    other = SHM_DIR / f"x{shm_prefix}1-0"  # does not start with the prefix
    odd = SHM_DIR / f"{shm_prefix}notapid"
    for path in (other, odd):
        path.write_bytes(b"?")
    try:
        assert reclaim_orphans(shm_prefix, max_age_s=600) == []
        removed = reclaim_orphans(shm_prefix, max_age_s=600, now=time.time() + 3600)
        assert [(r.name, r.owner_pid) for r in removed] == [(odd.name, None)]
        assert other.exists()
    finally:
        other.unlink(missing_ok=True)
        odd.unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("pdserve-kv-123-abcdef", 123),
        ("pdserve-kv-123-", None),
        ("pdserve-kv--abc", None),
        ("pdserve-kv-12a-abc", None),
        ("other-123-abc", None),
    ],
)
def test_parse_owner_pid(name: str, want: int | None) -> None:
    assert parse_owner_pid(name) == want


def test_segment_name_round_trips() -> None:
    name = segment_name("req/with:odd chars", owner_pid=77)
    assert parse_owner_pid(name) == 77 and "/" not in name
    assert name == segment_name("req/with:odd chars", owner_pid=77)
    assert name != segment_name("req/with:odd chars!", owner_pid=77)


def test_owner_alive() -> None:
    assert owner_alive(os.getpid())
    assert owner_alive(os.getpid(), since=time.time())
    assert not owner_alive(0) and not owner_alive(-5)


def test_missing_dir_and_bad_age(tmp_path: Path) -> None:
    assert reclaim_orphans(shm_dir=tmp_path / "absent") == []
    with pytest.raises(ValueError, match="max_age_s"):
        reclaim_orphans(max_age_s=0)
