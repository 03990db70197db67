"""One service of a local cluster as a child process: start it, read its port, stop it.

Children get ``PR_SET_PDEATHSIG`` (Linux): the kernel sends them SIGTERM when the thread that
started them dies, so no service outlives a launcher that is killed outright.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import deathsig
from pdserve.errors import WorkerUnavailableError
from pdserve.security.options import INSECURE, SecurityOptions

HOST = "127.0.0.1"


@dataclass(slots=True)
class ServiceProcess:
    """One service child process: how to start it, where it logs, which port it bound."""

    name: str
    module: str
    args: list[str]
    port_file: Path
    log_file: Path
    role: str | None = None
    """Worker role ("prefill", "decode", "mixed"), None for the other services."""
    http: bool = False
    """Serves HTTP (the gateway: health is ``GET /health``), not gRPC; HTTPS when the
    ``security`` its health is checked with has a CA."""
    proc: subprocess.Popen[bytes] | None = None
    port: int | None = None

    @property
    def address(self) -> str:
        if self.port is None:
            raise WorkerUnavailableError(f"{self.name} has not reported its port yet")
        return f"{HOST}:{self.port}"

    def spawn(self, env: dict[str, str], *, port: int = 0) -> None:
        """Start ``python -m MODULE --port P --port-file F ARGS`` with output to the log file
        (appended to: a restart's log follows its predecessor's). ``port`` 0: any free port."""
        argv = [
            sys.executable,
            "-m",
            self.module,
            "--port",
            str(port),
            "--port-file",
            str(self.port_file),
        ]
        # A port file left by an earlier run of the same service would name a dead port.
        self.port_file.unlink(missing_ok=True)
        with self.log_file.open("ab") as log:
            self.proc = subprocess.Popen(
                deathsig.wrap([*argv, *self.args]),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                # Own process group: a Ctrl-C in the terminal reaches the launcher only, which
                # then stops the services in order.
                process_group=0,
            )

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the service's log."""
        if not self.log_file.exists():
            return ""
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def check_alive(self) -> None:
        """Raise WorkerUnavailableError, with the log's tail, if the process has exited."""
        if self.proc is None or self.proc.poll() is not None:
            status = None if self.proc is None else self.proc.returncode
            raise WorkerUnavailableError(
                f"{self.name} exited (status {status}); last log lines of {self.log_file}:\n"
                f"{self.log_tail()}"
            )

    def is_healthy(self, security: SecurityOptions = INSECURE) -> bool:
        """The service's health check says it serves (gRPC health, or HTTP ``/health``)."""
        if self.http:
            return http_healthy(self.address, ca=security.tls.ca)
        return healthy(self.address, security)

    def read_port(self) -> bool:
        """True once the port file exists (the service is serving)."""
        if self.port is None and self.port_file.exists():
            self.port = int(self.port_file.read_text().strip())
        return self.port is not None


def healthy(address: str, security: SecurityOptions = INSECURE) -> bool:
    """True when the gRPC health check of the server at ``address`` says SERVING (over TLS
    when ``security`` says so; health needs no credential)."""
    with security.probe_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def http_healthy(address: str, ca: Path | None = None) -> bool:
    """True when ``GET http://address/health`` answers 200; ``https://`` checked against the
    CA bundle ``ca`` when one is given."""
    scheme, context = "http", None
    if ca is not None:
        scheme, context = "https", ssl.create_default_context(cafile=str(ca))
    url = f"{scheme}://{address}/health"
    try:
        with urllib.request.urlopen(url, timeout=2.0, context=context) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):  # HTTPError (503) is a URLError; so are TLS errors
        return False


def terminate(procs: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM all, wait up to ``grace_s`` in total, SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
