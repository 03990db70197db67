"""``pdserve certs DIR``: a local certificate authority and the certificates of one cluster.

For local and test use (a real deployment brings its own PKI). Writes into ``DIR``:

=====================  ===================================================================
``ca.pem``, ``ca.key``  the CA (``--tls-ca`` of every service and client)
``node.pem/.key``      the cluster members' certificate: serverAuth and clientAuth, common
                       name ``pdserve-cluster`` (the identity internal services admit over
                       mutual TLS), names ``localhost``, ``127.0.0.1``, ``::1``, this host's
                       name and any ``--host``
``client.pem/.key``    a client's certificate (clientAuth, common name ``pdserve-client``) for
                       a router that demands client certificates; not a cluster member
``internal-token``     the cluster's internal token (64 hex digits)
=====================  ===================================================================

Keys and the token are written with mode 0600. Existing files are kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.errors import InvalidArgumentError
from pdserve.security.auth import DEFAULT_IDENTITY, write_secret

CLIENT_IDENTITY = "pdserve-client"
TOKEN_FILE = "internal-token"


@dataclass(frozen=True, slots=True)
class ClusterCerts:
    """The files ``make_certs`` wrote (see the module docstring)."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def node_cert(self) -> Path:
        return self.dir / "node.pem"

    @property
    def node_key(self) -> Path:
        return self.dir / "node.key"

    @property
    def client_cert(self) -> Path:
        return self.dir / "client.pem"

    @property
    def client_key(self) -> Path:
        return self.dir / "client.key"

    @property
    def token(self) -> Path:
        return self.dir / TOKEN_FILE

    def complete(self) -> bool:
        files = (self.ca, self.node_cert, self.node_key, self.client_cert, self.client_key)
        return all(p.is_file() for p in (*files, self.token, self.dir / "ca.key"))


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_secret(path, pem.decode().strip())


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve local"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            out.append(x509.DNSName(host))
    return out


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_name: x509.Name,
    *,
    days: int,
    usages: Sequence[x509.ObjectIdentifier],
    hosts: Sequence[str] = (),
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName(_alt_names(hosts)), False)
    return builder.sign(ca_key, hashes.SHA256())


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_certs(
    directory: Path, *, hosts: Sequence[str] = (), days: int = 365, force: bool = False
) -> ClusterCerts:
    """Write a CA, the node and client certificates and an internal token into ``directory``
    (see the module docstring); an existing complete set is kept unless ``force``."""
    if days < 1:
        raise InvalidArgumentError("--days", f"must be >= 1, got {days}")
    out = ClusterCerts(Path(directory))
    if out.complete() and not force:
        return out
    out.dir.mkdir(parents=True, exist_ok=True)
    out.dir.chmod(0o700)
    ca_key = _key()
    ca_name = _name("pdserve local CA")
    now = datetime.datetime.now(datetime.UTC)
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(out.dir / "ca.key", ca_key)
    _write_cert(out.ca, ca)
    node_hosts = ["localhost", "127.0.0.1", "::1", socket.gethostname(), *hosts]
    node_key = _key()
    node = _issue(
        DEFAULT_IDENTITY, node_key, ca_key, ca_name, days=days, hosts=node_hosts,
        usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
    )  # fmt: skip
    _write_key(out.node_key, node_key)
    _write_cert(out.node_cert, node)
    client_key = _key()
    client = _issue(
        CLIENT_IDENTITY, client_key, ca_key, ca_name, days=days,
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )  # fmt: skip
    _write_key(out.client_key, client_key)
    _write_cert(out.client_cert, client)
    write_secret(out.token, secrets.token_hex(32))
    return out


def main_certs(argv: Sequence[str]) -> int:
    """``pdserve certs DIR``: see the module docstring."""
    p = argparse.ArgumentParser(
        prog="pdserve certs",
        description="make a local CA, cluster and client certificates and an internal token",
    )
    p.add_argument("dir", type=Path, help="directory to write (created; mode 0700)")
    p.add_argument("--host", action="append", default=[], metavar="NAME",
                   help="another name or IP address of the cluster, repeatable")  # fmt: skip
    p.add_argument("--days", type=int, default=365, help="validity of every certificate")
    p.add_argument("--force", action="store_true", help="replace an existing set")
    args = p.parse_args(list(argv))
    existing = ClusterCerts(args.dir).complete() and not args.force
    out = make_certs(args.dir, hosts=args.host, days=args.days, force=args.force)
    verb = "kept the existing" if existing else "wrote"
    print(
        f"{verb} CA, certificates and internal token in {out.dir}\n"
        f"  pdserve up --tls {out.dir}          # a cluster with TLS, mTLS and the token\n"
        f"  services: --tls-cert {out.node_cert} --tls-key {out.node_key} "
        f"--tls-ca {out.ca} --tls-client-auth --internal-token-file {out.token}"
    )
    return 0
