"""TLS settings of one process, as server and as client, from PEM files.

One ``TlsConfig`` serves both directions, because in a cluster every service is a server and a
client of the others with the same identity:

* serving: ``cert`` + ``key`` turn TLS on for the process's port; with ``client_auth`` the
  handshake also demands a client certificate signed by ``ca`` (mutual TLS);
* calling: channels use TLS whenever this process serves TLS or has a ``ca``; they check the
  server's certificate against ``ca`` (the system's roots when unset) and present ``cert`` +
  ``key`` as the client certificate, so one certificate with both the serverAuth and clientAuth
  usages (what ``pdserve certs`` makes) is a cluster member's whole identity.

This module reads files and builds grpc credentials only; no certificate is parsed here (see
``pdserve.security.certs`` for making them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.errors import InvalidArgumentError


def _read(path: Path, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise InvalidArgumentError(flag, f"cannot read {path}: {err.strerror or err}") from err
    if b"-----BEGIN" not in data:
        raise InvalidArgumentError(flag, f"{path} is not a PEM file")
    return data


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Certificates of one process (see the module docstring). All None: plaintext."""

    cert: Path | None = None
    """PEM certificate chain: served, and presented as the client certificate."""
    key: Path | None = None
    """PEM private key of ``cert``."""
    ca: Path | None = None
    """PEM bundle of the CAs that sign the servers this process calls and, with
    ``client_auth``, its callers' certificates."""
    client_auth: bool = False
    """Serving: refuse a handshake without a client certificate signed by ``ca``."""
    server_name: str | None = None
    """Calling: the name checked in server certificates instead of the address's host."""

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidArgumentError("--tls-key", "give --tls-cert and --tls-key together")
        if self.client_auth and (self.ca is None or self.cert is None):
            raise InvalidArgumentError(
                "--tls-client-auth", "needs --tls-ca (to check clients) and --tls-cert/--tls-key"
            )

    @property
    def serving(self) -> bool:
        """Whether the server port speaks TLS."""
        return self.cert is not None

    @property
    def calling(self) -> bool:
        """Whether channels to other services speak TLS."""
        return self.cert is not None or self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise InvalidArgumentError("--tls-cert", "serving TLS needs a certificate and key")
        pair = (_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))
        ca = _read(self.ca, "--tls-ca") if self.ca is not None else None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=ca, require_client_auth=self.client_auth
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca, "--tls-ca") if self.ca is not None else None
        key = _read(self.key, "--tls-key") if self.key is not None else None
        cert = _read(self.cert, "--tls-cert") if self.cert is not None else None
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def channel_options(self) -> tuple[tuple[str, str], ...]:
        """Options a TLS channel needs besides its credentials (the name override)."""
        if self.server_name:
            return (("grpc.ssl_target_name_override", self.server_name),)
        return ()
