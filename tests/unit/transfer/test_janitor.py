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
    owner_alive,
    parse_owner_pid,
    reclaim_orphans,
    segment_name,
)
from pdserve.transfer.shm import ShmSender
from tests.unit.transfer._shm_child import hand_off_and_hang
from tests.unit.transfer.conftest import leftovers, make_layout


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
        mine = ShmSender(prefix=shm_prefix)
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


def test_expired_segment_of_a_live_owner_is_reclaimed(shm_prefix: str) -> None:
    old, new = ShmSender(prefix=shm_prefix), ShmSender(prefix=shm_prefix)
    old.begin("old", make_layout(), 4)
    new.begin("new", make_layout(), 4)
    hour_ago = time.time() - 3600
    os.utime(SHM_DIR / old.name, (hour_ago, hour_ago))
    removed = reclaim_orphans(shm_prefix, max_age_s=600)
    assert [(r.name, r.reason) for r in removed] == [(old.name, ReclaimReason.EXPIRED)]
    assert removed[0].age_s >= 3600
    assert leftovers(shm_prefix) == [new.name]
    old.abort()  # already gone: still fine
    new.abort()
    assert leftovers(shm_prefix) == []


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
    assert not owner_alive(0) and not owner_alive(-5)


def test_missing_dir_and_bad_age(tmp_path: Path) -> None:
    assert reclaim_orphans(shm_dir=tmp_path / "absent") == []
    with pytest.raises(ValueError, match="max_age_s"):
        reclaim_orphans(max_age_s=0)
