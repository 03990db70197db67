"""``pdserve up`` as a child process, with what it printed: the router, HTTP and metrics URLs.

The tests read the addresses from the banner the command prints, as a person would, so a
banner that stops naming them fails the tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pdserve import deathsig

READY_LINE = "Ctrl-C stops everything."
_ROUTER = re.compile(r"pdserve is up: router at (\S+) ")
_HTTP = re.compile(r"OpenAI-compatible HTTP API at (https?://\S+)/v1 ")
_METRICS = re.compile(r"^\s+(\S+)\s+(http://\S+/metrics)$")


@dataclass
class UpProcess:
    """A running ``pdserve up`` and the addresses its banner named."""

    proc: subprocess.Popen[str]
    banner: list[str] = field(default_factory=list)
    router: str = ""
    http_url: str | None = None
    metrics: dict[str, str] = field(default_factory=dict)
    """Service name -> ``/metrics`` URL."""


def _read_banner(up: UpProcess) -> None:
    assert up.proc.stdout is not None
    for line in up.proc.stdout:  # blocks until the child prints or exits
        line = line.rstrip("\n")
        up.banner.append(line)
        if m := _ROUTER.search(line):
            up.router = m.group(1)
        if m := _HTTP.search(line):
            up.http_url = m.group(1)
        if m := _METRICS.match(line):
            up.metrics[m.group(1)] = m.group(2)
        if line == READY_LINE:
            return
    raise AssertionError("pdserve up exited before it was up:\n" + "\n".join(up.banner))


@contextmanager
def pdserve_up(
    model_dir: Path, args: Sequence[str], log_dir: Path, env: Mapping[str, str] | None = None
) -> Iterator[UpProcess]:
    """Start ``pdserve up --model DIR ARGS`` (``env`` added to this process's environment) and
    yield once it printed its banner; Ctrl-C (SIGINT) at the end, as a person stops it."""
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model_dir),
            "--log-dir", str(log_dir), *args]  # fmt: skip
    proc = subprocess.Popen(
        deathsig.wrap(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    up = UpProcess(proc)
    try:
        _read_banner(up)
        yield up
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
