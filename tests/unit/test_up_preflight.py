"""``pdserve up`` refuses a taken port at once, naming the flag, before starting anything."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process (this one) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--port", "{p}", "--no-http"], "--port"),
        (["--port", "0", "--http-port", "{p}"], "--http-port"),
        (["--port", "0", "--no-http", "--metrics-base-port", "{p}"], "--metrics-base-port"),
    ],
)
def test_a_taken_port_stops_up_at_once_naming_its_flag(
    taken: int, flags: list[str], named: str
) -> None:
    argv = [f.format(p=taken) for f in flags]
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "up", "--preset", "tiny", *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    lines = [ln for ln in done.stderr.splitlines() if not ln.startswith("warning: insecure")]
    assert lines == [
        f"pdserve up: error: {named}: port {taken} is already in use; choose another with "
        f"{named} (0: {'free ports' if named == '--metrics-base-port' else 'any free port'})"
    ]
    assert "starting pdserve" not in done.stdout
