"""The KV store's disk tier: one file per spilled entry in a directory of this process's own.

The store keeps its index in memory, so a file outlives its meaning when the process dies. Each
store therefore writes into ``{root}/kvstore-{pid}`` and, on start, removes the directories of
stores whose pid no longer runs (a store killed with SIGKILL leaves its directory behind).

Files are written and read synchronously: the store runs on one event-loop thread, and a spill
or reload of one entry (a KV block or one request's payload, MBs) from the page cache takes
milliseconds. A byte budget bounds the directory; the store decides what to spill or drop.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from pdserve.errors import CapacityError, InvalidArgumentError, KVTransferError

logger = logging.getLogger(__name__)

DIR_PREFIX = "kvstore-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def reclaim_dead_dirs(root: Path) -> list[Path]:
    """Remove ``kvstore-{pid}`` directories under ``root`` whose pid is not running."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        pid_text = entry.name.removeprefix(DIR_PREFIX)
        if entry.name == pid_text or not pid_text.isdigit() or not entry.is_dir():
            continue
        pid = int(pid_text)
        if pid == os.getpid() or _pid_alive(pid):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


class DiskTier:
    """Spilled payloads as files under a byte budget. ``close()`` removes the directory."""

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise InvalidArgumentError("disk_bytes", f"must be >= 1, got {capacity_bytes}")
        root.mkdir(parents=True, exist_ok=True)
        for stale in reclaim_dead_dirs(root):
            logger.info("removed the spill directory of a dead KV store: %s", stale)
        self.capacity_bytes = capacity_bytes
        self.path = root / f"{DIR_PREFIX}{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        for leftover in self.path.iterdir():  # a recycled pid: nothing here is ours
            leftover.unlink()
        self.used_bytes = 0
        self._sizes: dict[str, int] = {}

    @staticmethod
    def file_name(key: str, version: int) -> str:
        """Keys may hold any character; the file name is a digest of the key and version."""
        return f"{hashlib.blake2b(key.encode(), digest_size=16).hexdigest()}-{version}"

    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def write(
        self, name: str, header: bytes, parts: Sequence[bytes | bytearray | memoryview]
    ) -> None:
        """Store ``header`` and the data ``parts`` as ``name``; ``CapacityError`` if over the
        budget."""
        size = len(header) + sum(len(p) for p in parts)
        if size > self.free_bytes():
            raise CapacityError(
                f"KV store disk tier full: {size} bytes needed, {self.free_bytes()} free"
            )
        tmp = self.path / f"{name}.tmp"
        try:
            with tmp.open("wb") as f:
                f.write(header)
                for part in parts:
                    f.write(part)
            os.replace(tmp, self.path / name)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise CapacityError(f"KV store could not spill to {self.path}: {err}") from err
        self._sizes[name] = size
        self.used_bytes += size

    def read(self, name: str, header_len: int) -> tuple[bytes, bytes]:
        """The header and data written as ``name`` (the file stays until ``delete``)."""
        try:
            blob = (self.path / name).read_bytes()
        except OSError as err:
            raise KVTransferError(f"KV store could not reload {name} from disk: {err}") from err
        if len(blob) != self._sizes.get(name, -1):
            raise KVTransferError(f"KV store spill file {name} is truncated")
        return blob[:header_len], blob[header_len:]

    def delete(self, name: str) -> None:
        size = self._sizes.pop(name, None)
        if size is None:
            return
        self.used_bytes -= size
        (self.path / name).unlink(missing_ok=True)

    def close(self) -> None:
        self._sizes.clear()
        self.used_bytes = 0
        shutil.rmtree(self.path, ignore_errors=True)
