"""``SecurityOptions``: how one service process serves and calls, shared by every service.

Every service takes the same flags (``add_security_args``; each defaults to a ``PDSERVE_*``
environment variable) and turns them into one ``SecurityOptions`` (``security_from_args``),
which then builds all of the process's sockets:

* ``bind(server, address)``: the server port, TLS or plaintext (``TlsConfig``);
* ``internal_auth()``: the check internal services put in front of every method (the cluster
  token, or a mutual-TLS peer with the cluster identity), None when neither is configured;
* ``aio_channel(address)``: a channel to another service, TLS when configured, carrying the
  internal token on every call (as call credentials over TLS, by an interceptor otherwise);
* ``probe_channel(address)``: a blocking channel for health checks (``pdserve up``).

With no flag set everything is plaintext and open: the insecure local mode of ``pdserve up``
on 127.0.0.1. ``docs/security.md`` has the threat model and a secured set-up.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pdserve.security.auth import (
    DEFAULT_IDENTITY,
    InternalAuth,
    bearer_interceptors,
    load_token,
)
from pdserve.security.tls import TlsConfig

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


@dataclass(frozen=True, slots=True)
class SecurityOptions:
    """TLS, the internal credential and reflection of one process (see the module doc)."""

    tls: TlsConfig = field(default_factory=TlsConfig)
    internal_token: str | None = field(default=None, repr=False)
    """The cluster's shared secret, sent on every call to another service and required of
    callers by internal services; None: not configured."""
    internal_identity: str = DEFAULT_IDENTITY
    """Common name of the client certificates admitted as cluster members (mutual TLS)."""
    reflection: bool = False
    """Serve gRPC server reflection (off by default: it lists every method to anyone)."""

    def internal_auth(self) -> InternalAuth | None:
        """The caller check of an internal service; None when nothing is configured (open)."""
        identities = frozenset({self.internal_identity}) if self.tls.client_auth else frozenset()
        auth = InternalAuth(self.internal_token, identities)
        return auth if auth.enabled else None

    def bind(self, server: grpc.aio.Server, address: str) -> int:
        """Add the listening port (TLS when a certificate is configured); the bound port, 0
        if binding failed."""
        if self.tls.serving:
            return server.add_secure_port(address, self.tls.server_credentials())
        return server.add_insecure_port(address)

    def aio_channel(
        self,
        address: str,
        *,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> grpc.aio.Channel:
        """An asyncio channel to another service of the cluster."""
        opts = [*options, *self.tls.channel_options()]
        if self.tls.calling:
            creds = self.tls.channel_credentials()
            if self.internal_token is not None:
                creds = grpc.composite_channel_credentials(
                    creds, grpc.access_token_call_credentials(self.internal_token)
                )
            return grpc.aio.secure_channel(
                address, creds, options=opts, interceptors=list(interceptors) or None
            )
        extra = bearer_interceptors(self.internal_token) if self.internal_token else []
        return grpc.aio.insecure_channel(
            address, options=opts, interceptors=[*interceptors, *extra] or None
        )

    def probe_channel(self, address: str) -> grpc.Channel:
        """A blocking channel for health checks (which need no credential, only TLS)."""
        if self.tls.calling:
            return grpc.secure_channel(
                address, self.tls.channel_credentials(), options=list(self.tls.channel_options())
            )
        return grpc.insecure_channel(address)

    def warn_if_open(self, service: str, host: str) -> None:
        """Log a warning when an internal service listens beyond loopback without protection."""
        if self.internal_auth() is None and host not in LOOPBACK_HOSTS:
            logger.warning(
                "%s listens on %s without an internal credential: anyone who reaches the port "
                "can call it (see docs/security.md)",
                service, host,
            )  # fmt: skip


INSECURE = SecurityOptions()
"""Plaintext, no credential: the default of every service and of ``pdserve up``."""


def _env(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(f"PDSERVE_{name}", "")
    return value or None


def add_security_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """The security flags of every service (defaults from ``PDSERVE_TLS_CERT``, ...)."""
    g = parser.add_argument_group("security (see docs/security.md)")
    g.add_argument("--tls-cert", type=Path, default=_env(env, "TLS_CERT"),
                   help="PEM certificate chain: served, and shown to services called")  # fmt: skip
    g.add_argument("--tls-key", type=Path, default=_env(env, "TLS_KEY"),
                   help="PEM private key of --tls-cert")  # fmt: skip
    g.add_argument("--tls-ca", type=Path, default=_env(env, "TLS_CA"),
                   help="PEM CA bundle that signs the services called (and clients, with "
                   "--tls-client-auth); alone: call services over TLS")  # fmt: skip
    g.add_argument("--tls-client-auth", action="store_true",
                   default=_env(env, "TLS_CLIENT_AUTH") == "1",
                   help="require a client certificate signed by --tls-ca (mutual TLS)")  # fmt: skip
    g.add_argument("--tls-server-name", default=_env(env, "TLS_SERVER_NAME"),
                   help="name checked in the certificates of services called, instead of "
                   "their address's host")  # fmt: skip
    g.add_argument("--internal-token-file", type=Path, default=None,
                   help="file holding the cluster's internal token (default: "
                   "$PDSERVE_INTERNAL_TOKEN_FILE, else $PDSERVE_INTERNAL_TOKEN)")  # fmt: skip
    identity = _env(env, "INTERNAL_IDENTITY") or DEFAULT_IDENTITY
    g.add_argument("--internal-identity", default=identity,
                   help="common name of client certificates admitted as cluster members "
                   "(with --tls-client-auth)")  # fmt: skip
    g.add_argument("--reflection", action="store_true", default=_env(env, "REFLECTION") == "1",
                   help="serve gRPC server reflection (off by default)")  # fmt: skip


def security_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> SecurityOptions:
    """The options the flags of ``add_security_args`` give; ``InvalidArgumentError`` names a
    bad flag (an unreadable token file, a key without a certificate, ...)."""
    tls = TlsConfig(
        cert=args.tls_cert,
        key=args.tls_key,
        ca=args.tls_ca,
        client_auth=args.tls_client_auth,
        server_name=args.tls_server_name,
    )
    if tls.serving:
        tls.server_credentials()  # unreadable files fail at start, naming the flag
    return SecurityOptions(
        tls=tls,
        internal_token=load_token(args.internal_token_file, env),
        internal_identity=args.internal_identity,
        reflection=args.reflection,
    )
