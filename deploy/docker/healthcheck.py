#!/usr/bin/env python3
"""The pdserve image's health check (/usr/local/bin/pdserve-healthcheck): exit 0 when the
service in this container answers its health check, 1 when not.

    pdserve-healthcheck                  # the Dockerfile's HEALTHCHECK: what PID 1 runs
    pdserve-healthcheck grpc PORT        # gRPC health (TLS from PDSERVE_TLS_*, as the service)
    pdserve-healthcheck plain PORT       # gRPC health in plaintext (the planner's)
    pdserve-healthcheck http PORT        # the gateway's GET /health (HTTPS with PDSERVE_TLS_CERT)

Kubernetes' own gRPC probe speaks no TLS, so secured pods probe with this (an exec probe).
The TLS settings are the service's own: ``PDSERVE_TLS_*`` read by the same flags
(``pdserve.security.options``), so a service under mutual TLS is probed with the member
certificate it serves with; health needs no token. Without arguments the service is read
from PID 1's command line (``python -m services.NAME ... --port N``); a container running
anything else (an init step) is healthy.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pdserve.security.options import add_security_args, security_from_args
from pdserve.service_process import healthy, http_healthy

DEFAULT_PORTS = {
    "services.router": 50051,
    "services.scheduler": 50052,
    "services.planner": 50053,
    "services.kvstore": 50060,
    "services.gateway": 8000,
}
"""Each service's default --port; workers have none (0: a free port), so they need --port."""
KINDS = {"services.gateway": "http", "services.planner": "plain"}
"""How each service is probed; the rest: gRPC health with the service's TLS."""
INSECURE_DROPS = ("PDSERVE_TLS_", "PDSERVE_ROUTER_TLS_", "PDSERVE_INTERNAL_TOKEN")
"""What pdserve-entrypoint drops under PDSERVE_INSECURE=1 (the health check runs without it)."""


def from_command_line(argv: list[str]) -> tuple[str, int] | None:
    """(kind, port) of the service ``argv`` runs, None when it runs no service."""
    if "-m" not in argv[:-1]:
        return None
    module = argv[argv.index("-m") + 1]
    if not module.startswith("services."):
        return None
    port = DEFAULT_PORTS.get(module)
    for i, arg in enumerate(argv):
        if arg == "--port" and i + 1 < len(argv):
            port = int(argv[i + 1])
        elif arg.startswith("--port="):
            port = int(arg.split("=", 1)[1])
    if port is None or port == 0:
        raise SystemExit(f"pdserve-healthcheck: {module} runs without a --port to probe")
    return KINDS.get(module, "grpc"), port


def service_env(env: dict[str, str]) -> dict[str, str]:
    """The environment the service runs with (see entrypoint.sh)."""
    if env.get("PDSERVE_INSECURE") != "1":
        return env
    return {k: v for k, v in env.items() if not k.startswith(INSECURE_DROPS)}


def check(kind: str, port: int, env: dict[str, str]) -> bool:
    env = service_env(env)
    address = f"127.0.0.1:{port}"
    if kind == "http":
        https = bool(env.get("PDSERVE_TLS_CERT"))
        ca = env.get("PDSERVE_TLS_CA") or env.get("PDSERVE_ROUTER_TLS_CA")
        if https and not ca:
            raise SystemExit("pdserve-healthcheck: HTTPS needs PDSERVE_TLS_CA to check it")
        return http_healthy(address, ca=Path(ca) if https and ca else None)
    if kind == "plain":
        return healthy(address)
    parser = argparse.ArgumentParser()
    add_security_args(parser, env)
    return healthy(address, security_from_args(parser.parse_args([]), env))


def main(argv: list[str]) -> int:
    if argv:
        if len(argv) != 2 or argv[0] not in ("grpc", "plain", "http"):
            print(__doc__, file=sys.stderr)
            return 2
        target: tuple[str, int] | None = (argv[0], int(argv[1]))
    else:
        raw = Path("/proc/1/cmdline").read_bytes()
        target = from_command_line([a.decode() for a in raw.split(b"\0") if a])
    if target is None:
        return 0
    ok = check(*target, dict(os.environ))
    if not ok:
        print(f"pdserve-healthcheck: {target[0]} health on port {target[1]}: not serving")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
