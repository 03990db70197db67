"""``pdserve up``'s state file: private, atomic, ignored once its process is gone; and a bare
``pdserve status`` that says how to point it when nothing runs."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.status import main_status
from pdserve.up_state import UpState, publish, running, runtime_dir


def _state(pid: int) -> UpState:
    return UpState(pid, "127.0.0.1:50051", "redis://:pw@127.0.0.1:6390/0", "pdserve", None, "/l")


def test_the_state_is_private_and_read_back(tmp_path: Path) -> None:
    directory = tmp_path / "rt"
    path = publish(_state(os.getpid()), directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert running(directory) == [_state(os.getpid())]
    assert not list(directory.glob(".*.tmp"))


def test_a_dead_process_state_is_dropped(tmp_path: Path) -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           check=True, capture_output=True, text=True)  # fmt: skip
    dead = int(child.stdout)
    path = publish(_state(dead), tmp_path)
    (tmp_path / "up-junk.json").write_text("{not json")
    assert running(tmp_path) == []
    assert not path.exists()


def test_runtime_dir_order() -> None:
    assert runtime_dir({"PDSERVE_RUNTIME_DIR": "/a", "XDG_RUNTIME_DIR": "/b"}) == Path("/a")
    assert runtime_dir({"XDG_RUNTIME_DIR": "/b"}) == Path("/b/pdserve")
    assert runtime_dir({}).name == f"pdserve-{os.getuid()}"


def test_bare_status_with_nothing_running_says_how_to_point_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PDSERVE_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert main_status([]) == 1
    out = capsys.readouterr().out
    assert "no running 'pdserve up' found" in out and "--redis-url" in out
