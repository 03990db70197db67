"""The gateway's TLS, both ways: HTTPS on its own listener, and TLS to a secured router.

The gateway is a client of the router, not a cluster member: it holds no internal token, and
the router authenticates each call by the API key of the HTTP caller it carries. So its two
sides take separate certificates:

* serving: ``--tls-cert``/``--tls-key`` [``PDSERVE_TLS_CERT``/``PDSERVE_TLS_KEY``] make the
  HTTP listener HTTPS (uvicorn's ``ssl_certfile``/``ssl_keyfile``);
* calling the router: ``--router-tls-ca`` checks its certificate (``--router-tls`` alone: the
  system's CAs), ``--router-tls-cert``/``--router-tls-key`` present a client certificate to a
  router that demands one (``--tls-client-auth`` there), ``--router-tls-server-name``
  overrides the name checked; each defaults to ``PDSERVE_ROUTER_TLS_...``.

Bad files fail at start, naming the flag.
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import InvalidArgumentError
from pdserve.security.tls import TlsConfig


def _env(env: Mapping[str, str], name: str) -> str | None:
    return env.get(f"PDSERVE_{name}") or None


@dataclass(frozen=True, slots=True)
class GatewayTls:
    """HTTPS of the listener (``cert``/``key``) and TLS to the router (``router``)."""

    cert: Path | None = None
    key: Path | None = None
    router: TlsConfig | None = None
    """None: the router is called over plaintext."""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidArgumentError("--tls-key", "give --tls-cert and --tls-key together")

    @property
    def https(self) -> bool:
        return self.cert is not None

    @property
    def scheme(self) -> str:
        return "https" if self.https else "http"

    def check(self) -> None:
        """Read every file now, so that a bad one fails at start naming its flag."""
        if self.cert is not None and self.key is not None:
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert, self.key)
            except (OSError, ssl.SSLError) as err:
                raise InvalidArgumentError(
                    "--tls-cert", f"cannot load {self.cert} with key {self.key}: {err}"
                ) from err
        if self.router is not None:
            try:
                self.router.channel_credentials()
            except InvalidArgumentError as err:  # named after the services' flags
                flag = err.field.replace("--tls-", "--router-tls-")
                raise InvalidArgumentError(flag, str(err).removeprefix(f"{err.field}: ")) from err


def add_gateway_tls_args(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    g = parser.add_argument_group("TLS (see docs/http-api.md and docs/security.md)")
    g.add_argument("--tls-cert", type=Path, default=_env(env, "TLS_CERT"),
                   help="PEM certificate chain: serve HTTPS")  # fmt: skip
    g.add_argument("--tls-key", type=Path, default=_env(env, "TLS_KEY"),
                   help="PEM private key of --tls-cert")  # fmt: skip
    g.add_argument("--router-tls", action="store_true", default=_env(env, "ROUTER_TLS") == "1",
                   help="call the router over TLS (implied by the other --router-tls-* "
                   "flags; alone: checked against the system's CAs)")  # fmt: skip
    g.add_argument("--router-tls-ca", type=Path, default=_env(env, "ROUTER_TLS_CA"),
                   help="PEM CA bundle that signs the router's certificate")  # fmt: skip
    g.add_argument("--router-tls-cert", type=Path, default=_env(env, "ROUTER_TLS_CERT"),
                   help="PEM client certificate for a router that demands one")  # fmt: skip
    g.add_argument("--router-tls-key", type=Path, default=_env(env, "ROUTER_TLS_KEY"),
                   help="PEM private key of --router-tls-cert")  # fmt: skip
    g.add_argument("--router-tls-server-name", default=_env(env, "ROUTER_TLS_SERVER_NAME"),
                   help="name checked in the router's certificate instead of the host of "
                   "--router")  # fmt: skip


def gateway_tls_from_args(args: argparse.Namespace) -> GatewayTls:
    """The settings the flags of ``add_gateway_tls_args`` give, files checked;
    ``InvalidArgumentError`` names a bad flag."""
    if (args.router_tls_cert is None) != (args.router_tls_key is None):
        raise InvalidArgumentError(
            "--router-tls-key", "give --router-tls-cert and --router-tls-key together"
        )
    router = None
    if args.router_tls or any(
        v is not None
        for v in (args.router_tls_ca, args.router_tls_cert, args.router_tls_server_name)
    ):
        router = TlsConfig(
            cert=args.router_tls_cert,
            key=args.router_tls_key,
            ca=args.router_tls_ca,
            server_name=args.router_tls_server_name,
        )
    tls = GatewayTls(cert=args.tls_cert, key=args.tls_key, router=router)
    tls.check()
    return tls
