"""Start a child that dies with its parent, without a ``preexec_fn``.

``python -m pdserve.deathsig PARENT_PID -- CMD ARGS...`` asks the kernel (Linux
``PR_SET_PDEATHSIG``) for SIGTERM when its parent dies, then execs ``CMD``; the request survives
exec. Doing this in a ``preexec_fn`` instead runs Python between fork and exec, which can abort
the child when the parent has other threads (gRPC's, for one). ``wrap`` builds the argv;
``free_port`` finds a port for such a child and ``stop`` ends it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1


def wrap(argv: Sequence[str]) -> list[str]:
    """``argv`` run through this shim on Linux (unchanged elsewhere)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-m", "pdserve.deathsig", str(os.getpid()), "--", *argv]


def free_port(host: str) -> int:
    """A TCP port on ``host`` that is free now (for a child to bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """Terminate ``proc`` and wait for it; kill it if it is still running after ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(args: Sequence[str]) -> None:
    if len(args) < 3 or args[1] != "--":
        raise SystemExit("usage: python -m pdserve.deathsig PARENT_PID -- CMD [ARGS...]")
    parent, cmd = int(args[0]), list(args[2:])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise SystemExit(f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}")
    if os.getppid() != parent:  # the parent died before the request took effect
        raise SystemExit(0)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
