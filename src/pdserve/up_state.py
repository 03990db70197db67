"""Where a running ``pdserve up`` says how to reach it, so that ``pdserve status`` needs no
flags: one JSON file per ``pdserve up`` process in the user's runtime directory.

::

    $PDSERVE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/pdserve, else /tmp/pdserve-UID   (mode 0700)
        up-PID.json   {"pid", "router", "redis_url", "namespace", "http_url", "log_dir"}  (0600)

The file holds the Redis URL with its password (an embedded Redis of ``--tls`` has one), so
both the directory and the file are the user's alone. ``pdserve up`` removes its file when it
stops; a file whose process is gone (killed) is ignored and removed by the next reader.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.errors import InvalidArgumentError
from pdserve.transfer.janitor import owner_alive


@dataclass(frozen=True, slots=True)
class UpState:
    pid: int
    router: str
    redis_url: str
    namespace: str
    http_url: str | None
    log_dir: str


def runtime_dir(env: Mapping[str, str] = os.environ) -> Path:
    if env.get("PDSERVE_RUNTIME_DIR"):
        return Path(env["PDSERVE_RUNTIME_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "pdserve"
    return Path(tempfile.gettempdir()) / f"pdserve-{os.getuid()}"


def publish(state: UpState, directory: Path) -> Path:
    """Write ``state`` (atomically: a reader never sees half a file); its path."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if directory.stat().st_uid != os.getuid():
        raise InvalidArgumentError("PDSERVE_RUNTIME_DIR", f"{directory} belongs to another user")
    path = directory / f"up-{state.pid}.json"
    tmp = directory / f".up-{state.pid}.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(state), f)
    os.replace(tmp, path)
    return path


def running(directory: Path) -> list[UpState]:
    """The ``pdserve up`` processes alive now that published their state, oldest first."""
    found = []
    for path in sorted(directory.glob("up-*.json"), key=lambda p: p.stat().st_mtime):
        try:
            state = UpState(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # not ours, or being replaced: skipped, never fatal
        if owner_alive(state.pid, since=path.stat().st_mtime):
            found.append(state)
        else:
            path.unlink(missing_ok=True)
    return found
