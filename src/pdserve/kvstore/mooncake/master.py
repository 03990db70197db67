"""``MasterProcess``: a ``mooncake_master`` child process, for ``pdserve up --kv-store
mooncake`` and tests.

The master keeps the Store's metadata (which object lies in which process's segment) and,
with ``--enable_http_metadata_server``, serves the transfer engines' metadata over HTTP, so a
cluster needs no etcd. It holds no KV itself: the workers lend it their segments
(``address``). It is started on free ports (or the given ones) and is ready once both ports
accept connections. Like ``EmbeddedRedis`` it never outlives its owner: ``stop()``, a
finalizer, and ``PR_SET_PDEATHSIG`` for an owner killed outright.
"""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
import urllib.request
import weakref
from pathlib import Path

from pdserve import deathsig
from pdserve.errors import WorkerUnavailableError
from pdserve.kvstore.mooncake.library import load


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class MasterProcess:
    """``with MasterProcess() as m: ... m.address() ...`` (see the module doc)."""

    def __init__(self) -> None:
        self.host = "127.0.0.1"
        self.port = deathsig.free_port(self.host)
        self.metadata_port = deathsig.free_port(self.host)
        self.metrics_port = deathsig.free_port(self.host)
        self._binary = load("kv_store").master_binary()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: tempfile.TemporaryDirectory[str] | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def address(self, **options: str | int) -> str:
        """The ``mooncake://`` address of this master (``options``: the address's query,
        e.g. ``segment="64MiB"``, ``replicas=2``)."""
        query = "".join(f"&{k}={v}" for k, v in options.items())
        return f"mooncake://{self.master}?metadata={self.metadata_url}{query}"

    def args(self) -> list[str]:
        """The command line (also what deploy manifests run)."""
        return [
            self._binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_port={self.metrics_port}",
            # The fill ratio of the segments past which Mooncake evicts objects (least
            # recently used first).
            "--eviction_high_watermark_ratio=0.9",
            "--enable_metric_reporting=false",
        ]

    def start(self, *, timeout_s: float = 15.0) -> MasterProcess:
        """Start the master and wait until its RPC and metadata ports accept connections."""
        if self.running:
            return self
        self._log = tempfile.TemporaryDirectory(prefix="pdserve-mooncake-")
        log_path = Path(self._log.name) / "master.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                deathsig.wrap(self.args()), stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        self._proc = proc
        self._finalizer = weakref.finalize(self, deathsig.stop, proc)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if _accepts(self.host, self.port) and _accepts(self.host, self.metadata_port):
                return self
            time.sleep(0.02)  # polling a child process for readiness; nothing to wait on
        text = log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise WorkerUnavailableError(f"mooncake_master did not start: {text.strip()}")

    def key_count(self) -> int:
        """Objects the master holds now (its ``master_key_count`` metric): leak checks."""
        url = f"http://{self.host}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        for line in text.splitlines():
            if line.startswith("master_key_count "):
                return int(float(line.split()[1]))
        raise WorkerUnavailableError(f"mooncake_master at {url} reports no master_key_count")

    def kill(self) -> None:
        """SIGKILL the master (fault tests); ``stop`` still cleans up."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def stop(self) -> None:
        """Terminate the master and wait for it. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._proc = None
        if self._log is not None:
            self._log.cleanup()
            self._log = None

    def __enter__(self) -> MasterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
