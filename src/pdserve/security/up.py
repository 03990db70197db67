"""``pdserve up``'s security: its flags, the insecure-mode warning, and how its greeting tells
a user to reach a secured cluster (``pdserve.launcher`` runs the cluster)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Protocol

from pdserve.security.certs import ClusterCerts

INSECURE_WARNING = (
    "warning: insecure local mode: plaintext gRPC, internal services open to any local "
    "process (listening on 127.0.0.1 only; pdserve up --tls DIR --api-keys FILE secures it, "
    "see docs/security.md)"
)
"""The one line ``pdserve up`` prints when started without ``--tls``."""


class SecuredCluster(Protocol):
    """What the greeting reads of a ``launcher.Cluster``."""

    @property
    def certs(self) -> ClusterCerts | None: ...

    router_client_auth: bool
    api_keys: Path | None


def add_up_security_args(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("security (docs/security.md; default: the insecure local mode)")
    s.add_argument("--tls", type=Path, metavar="DIR",
                   help="run secured with the certificates and token of 'pdserve certs DIR' "
                   "(made if missing): TLS, mutual TLS and a token between services, HTTPS at "
                   "the HTTP gateway, a password on the embedded Redis")  # fmt: skip
    s.add_argument("--router-client-auth", action="store_true",
                   help="with --tls: the router demands client certificates too")  # fmt: skip
    s.add_argument("--api-keys", type=Path, metavar="FILE",
                   help="API keys -> tenants (and quotas): the router, and so the HTTP "
                   "gateway, demands a key")  # fmt: skip


def how_to_call(cluster: SecuredCluster, address: str) -> str:
    """The lines of ``pdserve up``'s greeting that show how to reach the cluster. ``pdserve
    status`` needs no flag: it finds the running ``pdserve up`` (``up_state``), so a Redis
    password never reaches the terminal."""
    flags = ""
    certs = cluster.certs
    if certs is not None:
        flags += f" --tls-ca {certs.ca}"
        if cluster.router_client_auth:
            flags += f" --tls-cert {certs.client_cert} --tls-key {certs.client_key}"
    if cluster.api_keys is not None:
        flags += " --api-key $PDSERVE_API_KEY"
    return (
        f'  pdserve generate "Once upon a time" --router {address} --max-tokens 32{flags}\n'
        "  pdserve status"
    )
