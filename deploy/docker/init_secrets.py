#!/usr/bin/env python3
"""The secrets of a pdserve deployment, made once on its first start
(/usr/local/bin/pdserve-init-secrets in the image; the standard library and the ``pdserve``
command only).

    pdserve-init-secrets files DIR --host NAME...          # docker-compose's certs-init
    pdserve-init-secrets kubernetes --service NAME... --redis-url-template URL   # a Job

What it makes:

* ``pdserve certs`` (docs/security.md): the cluster's CA, the member certificate (common name
  ``pdserve-cluster``, a name for each ``--host``), the client certificate, the internal token;
* an API keys file with one demo key, held as its SHA-256 only (``sha256:...``): the key
  itself is printed once, when the file is made (compose), or kept in its own Secret (k8s);
* a Redis password, and ``redis.conf`` for redis-server's config-file argument
  (``requirepass`` and ``masterauth``, so a replica promoted by Sentinel asks the same).

``files`` writes into DIR and keeps what is there (``DIR/tls/``, ``api-keys.yaml``,
``redis-password``, ``redis.conf``; keys, token and password mode 0600). ``kubernetes`` makes
the same in a temporary directory and creates them as Secrets of the pod's namespace through
the API, with the pod's service account token (a Role allowing ``create`` on Secrets is
enough); a Secret that exists is kept (409), so the Job may run again:

* ``pdserve-tls``: ``ca.pem``, ``node.pem``, ``node.key``, ``client.pem``, ``client.key``,
  ``internal-token`` (the CA's key is not kept: nothing more is issued in the cluster);
* ``pdserve-api-keys``: ``api-keys.yaml``, ``demo-key``;
* ``pdserve-redis``: ``password`` and ``redis.conf``, for the Redis pods;
* ``pdserve-redis-url``: ``PDSERVE_REDIS_URL``, ``--redis-url-template`` with every
  ``{password}`` filled in (the services take it with ``envFrom``).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import secrets
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

TLS_FILES = ("ca.pem", "node.pem", "node.key", "client.pem", "client.key", "internal-token")
DEMO_TENANT = "demo"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
LABELS = {"app.kubernetes.io/part-of": "pdserve", "app.kubernetes.io/managed-by": "pdserve-init"}


def _write(path: Path, text: str, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def make_tls(directory: Path, hosts: Sequence[str]) -> None:
    """``pdserve certs`` into ``directory`` (kept when complete)."""
    argv = ["pdserve", "certs", str(directory)]
    for host in hosts:
        argv += ["--host", host]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    print(result.stdout + result.stderr, end="", file=sys.stderr)
    if result.returncode != 0:
        raise SystemExit(f"pdserve-init-secrets: {' '.join(argv)} failed ({result.returncode})")


def api_keys_yaml(key: str) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return (
        "# API keys of the router (docs/security.md). Made with one demo key, held here as\n"
        "# its SHA-256; add a line per client (the key, or sha256:HEX of it) and restart the\n"
        "# router and the scheduler.\n"
        f'keys:\n  "sha256:{digest}": {DEMO_TENANT}\n'
    )


def redis_conf(password: str) -> str:
    return f"requirepass {password}\nmasterauth {password}\n"


def make_files(directory: Path, hosts: Sequence[str]) -> None:
    """The ``files`` mode (see the module docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    make_tls(directory / "tls", hosts)
    keys = directory / "api-keys.yaml"
    if not keys.exists():
        key = "pdk-" + secrets.token_hex(24)
        _write(keys, api_keys_yaml(key))
        print(
            "pdserve: the demo API key (tenant 'demo'), shown this once:\n"
            f"pdserve:   PDSERVE_API_KEY={key}\n"
            f"pdserve: more keys: {keys} in the secrets volume (docs/deploy.md)",
            flush=True,
        )
    password_file = directory / "redis-password"
    if not password_file.exists():
        _write(password_file, secrets.token_hex(24) + "\n")
    conf = directory / "redis.conf"
    if not conf.exists():
        _write(conf, redis_conf(password_file.read_text().strip()))
    print(f"pdserve-init-secrets: secrets ready in {directory}", file=sys.stderr)


def service_hosts(services: Sequence[str], namespace: str, domain: str) -> list[str]:
    """Every name a Service of ``namespace`` is reached by."""
    out: list[str] = []
    for name in services:
        out += [name, f"{name}.{namespace}", f"{name}.{namespace}.svc",
                f"{name}.{namespace}.svc.{domain}"]  # fmt: skip
    return out


def secret_manifest(name: str, data: Mapping[str, str | bytes]) -> dict[str, object]:
    def encode(value: str | bytes) -> str:
        raw = value.encode() if isinstance(value, str) else value
        return base64.b64encode(raw).decode()

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": dict(LABELS)},
        "type": "Opaque",
        "data": {k: encode(v) for k, v in sorted(data.items())},
    }


def kubernetes_secrets(tls_dir: Path, redis_url_template: str) -> list[dict[str, object]]:
    """The Secrets (see the module docstring), from a ``pdserve certs`` directory."""
    if "{password}" not in redis_url_template:
        raise SystemExit("pdserve-init-secrets: --redis-url-template has no {password}")
    key = "pdk-" + secrets.token_hex(24)
    password = secrets.token_hex(24)
    return [
        secret_manifest("pdserve-tls", {f: (tls_dir / f).read_bytes() for f in TLS_FILES}),
        secret_manifest("pdserve-api-keys", {"api-keys.yaml": api_keys_yaml(key), "demo-key": key}),
        secret_manifest(
            "pdserve-redis", {"password": password, "redis.conf": redis_conf(password)}
        ),
        secret_manifest(
            "pdserve-redis-url",
            {"PDSERVE_REDIS_URL": redis_url_template.replace("{password}", password)},
        ),
    ]


class ApiServer:
    """The Kubernetes API, reached with a service account token over TLS."""

    def __init__(self, url: str, token: str, ca_file: Path | None) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)

    def create(self, namespace: str, manifest: Mapping[str, object]) -> bool:
        """POST the object: True when created, False when one of its name exists."""
        request = urllib.request.Request(
            f"{self.url}/api/v1/namespaces/{namespace}/secrets",
            data=json.dumps(manifest).encode(),
            method="POST",
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.context):
                return True
        except urllib.error.HTTPError as err:
            if err.code == 409:
                return False
            body = err.read().decode(errors="replace")[:500]
            raise SystemExit(
                f"pdserve-init-secrets: creating a Secret: HTTP {err.code}: {body}"
            ) from err


def make_kubernetes(args: argparse.Namespace) -> None:
    """The ``kubernetes`` mode (see the module docstring)."""
    namespace = args.namespace or (SERVICE_ACCOUNT / "namespace").read_text().strip()
    token = Path(args.token_file).read_text().strip()
    if args.api_server:
        url = args.api_server
    else:
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        host = f"[{host}]" if ":" in host else host
        url = f"https://{host}:{os.environ.get('KUBERNETES_SERVICE_PORT', '443')}"
    api = ApiServer(url, token, Path(args.ca_file) if args.ca_file else None)
    hosts = [*service_hosts(args.service, namespace, args.cluster_domain), *args.host]
    with tempfile.TemporaryDirectory(prefix="pdserve-secrets-") as tmp:
        make_tls(Path(tmp) / "tls", hosts)
        for manifest in kubernetes_secrets(Path(tmp) / "tls", args.redis_url_template):
            name = manifest["metadata"]["name"]  # type: ignore[index]
            created = api.create(namespace, manifest)
            print(f"pdserve-init-secrets: Secret {namespace}/{name}: "
                  f"{'created' if created else 'exists, kept'}", flush=True)  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve-init-secrets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="mode", required=True)
    files = sub.add_parser("files", help="write the secrets into a directory (compose)")
    files.add_argument("dir", type=Path)
    files.add_argument("--host", action="append", default=[], help="a name of the services")
    k8s = sub.add_parser("kubernetes", help="create the secrets as Secrets (a Job)")
    k8s.add_argument("--service", action="append", default=[],
                     help="a Service the certificate names, with its namespaced names")  # fmt: skip
    k8s.add_argument("--host", action="append", default=[], help="another name")
    k8s.add_argument("--redis-url-template", required=True,
                     help="the services' Redis URL, with {password} for the password")  # fmt: skip
    k8s.add_argument("--cluster-domain", default="cluster.local")
    k8s.add_argument("--namespace", help="default: the pod's")
    k8s.add_argument("--api-server", help="default: https://$KUBERNETES_SERVICE_HOST:PORT")
    k8s.add_argument("--token-file", default=str(SERVICE_ACCOUNT / "token"))
    k8s.add_argument("--ca-file", default=str(SERVICE_ACCOUNT / "ca.crt"))
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    if args.mode == "files":
        make_files(args.dir, args.host)
    else:
        make_kubernetes(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
