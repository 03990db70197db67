"""``pdserve up`` as a supervisor, run as a user runs it: a worker with a spare that keeps
dying is given up while the cluster serves on; a service it cannot do without that keeps
dying stops ``pdserve up`` with exit status 1 and a message naming it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest

from pdserve.client import Client

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def children(pid: int, module: str) -> list[int]:
    """Pids of the direct children of ``pid`` running ``python -m MODULE``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(") ", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if parent == pid and module.encode() in cmdline:
            found.append(int(stat.parent.name))
    return sorted(found)


def read_until(stream: IO[str], marker: str, seen: list[str]) -> str:
    """Lines of ``stream`` up to the first containing ``marker`` (which is returned)."""
    for line in stream:
        seen.append(line)
        if marker in line:
            return line
    raise AssertionError(f"{marker!r} never came; output:\n{''.join(seen)}")


def test_up_gives_up_a_spare_and_stops_without_its_scheduler(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    up = subprocess.Popen(
        [
            sys.executable, "-m", "pdserve.cli", "up", "--model", str(tiny_llama_dir),
            "--port", "0", "--log-dir", str(tmp_path), "--decode", "2", "--max-restarts", "0",
            "--worker-arg=--dtype=float32", "--worker-arg=--threads=1",
            "--worker-arg=--kv-blocks=128",
        ],
        cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert up.stdout is not None
    seen: list[str] = []
    try:
        ready = read_until(up.stdout, "pdserve is up", seen)
        address = ready.split("router at ", 1)[1].split()[0]
        decodes = children(up.pid, "services.decode")
        assert len(decodes) == 2, seen
        os.kill(decodes[0], signal.SIGKILL)
        read_until(up.stdout, "giving up on it", seen)
        with Client(address, timeout=60) as client:  # the spare decode worker serves
            done = client.generate([5, 6, 7, 8], max_tokens=4, temperature=0, ignore_eos=True)
        assert len(done.token_ids) == 4 and done.finish_reason == "length"
        assert up.poll() is None
        (scheduler,) = children(up.pid, "services.scheduler")
        os.kill(scheduler, signal.SIGKILL)
        read_until(up.stdout, "keeps dying; stopping", seen)
        assert up.wait(timeout=60) == 1
        assert "scheduler" in seen[-1] and "cannot serve without it" in "".join(seen)
        assert not children(up.pid, "services.router")  # it stopped everything
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=60)
