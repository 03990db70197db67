"""The pdserve image's scripts (deploy/docker), run here for real: the health check probes a
service under mutual TLS as that service's own settings say (and fails where it must), and
the secrets init makes the files compose mounts, printing the demo key once, and creates the
Kubernetes Secrets through an API server once each (a local HTTPS server that answers as
the API does: 201, then 409)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from pdserve.rpc.server import build_server
from pdserve.security.apikeys import ApiKeys
from pdserve.security.certs import ClusterCerts, make_certs
from pdserve.security.options import INSECURE, SecurityOptions
from pdserve.security.tls import TlsConfig
from tests.unit.deploy_scripts import healthcheck, init_secrets

MEMBER_ENV = {
    "PDSERVE_TLS_CERT": "node.pem",
    "PDSERVE_TLS_KEY": "node.key",
    "PDSERVE_TLS_CA": "ca.pem",
    "PDSERVE_TLS_CLIENT_AUTH": "1",
    "PDSERVE_TLS_SERVER_NAME": "pdserve-cluster",
}
"""docker-compose.yml's member settings (the files relative to the certificates' dir)."""


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    return make_certs(tmp_path_factory.mktemp("certs"), hosts=["pdserve-cluster"])


def member_env(certs: ClusterCerts) -> dict[str, str]:
    return {
        k: str(certs.dir / v) if v.endswith((".pem", ".key")) else v for k, v in MEMBER_ENV.items()
    }


def probe(server_side: SecurityOptions, *checks: tuple[str, dict[str, str]]) -> list[bool]:
    """Each ``(kind, env)`` health check of a real server with ``server_side``'s TLS."""

    async def main() -> list[bool]:
        server, port, health = build_server([], port=0, security=server_side)
        await server.start()
        await health.set_serving()
        try:
            return [
                await asyncio.to_thread(healthcheck.check, kind, port, env) for kind, env in checks
            ]
        finally:
            await server.stop(None)

    return asyncio.run(main())


def test_health_check_speaks_mutual_tls_as_the_service_does(certs: ClusterCerts) -> None:
    env = member_env(certs)
    server = SecurityOptions(
        tls=TlsConfig(cert=certs.node_cert, key=certs.node_key, ca=certs.ca, client_auth=True)
    )
    ok, plaintext, insecure = probe(
        server, ("grpc", env), ("grpc", {}), ("grpc", {**env, "PDSERVE_INSECURE": "1"})
    )
    assert ok and not plaintext and not insecure
    # A plaintext server (the planner's health; any service under PDSERVE_INSECURE=1).
    assert probe(INSECURE, ("plain", {}), ("grpc", {**env, "PDSERVE_INSECURE": "1"})) == [
        True,
        True,
    ]


def test_health_check_finds_the_service_and_its_port() -> None:
    find = healthcheck.from_command_line
    assert find(["python", "-m", "services.prefill", "--port", "50070"]) == ("grpc", 50070)
    assert find(["python", "-m", "services.gateway", "--port=8443"]) == ("http", 8443)
    assert find(["python", "-m", "services.planner"]) == ("plain", 50053)
    assert find(["sh", "-c", "test -f x || pdserve model init x"]) is None
    assert find(["python3", "/usr/local/bin/pdserve-init-secrets", "files", "/s"]) is None
    with pytest.raises(SystemExit, match="without a --port"):
        find(["python", "-m", "services.decode", "--model", "m"])
    required = {
        "services.router": ["--scheduler", "s:1", "--model", "m"],
        "services.gateway": ["--model", "m", "--router", "r:1"],
    }
    for module, port in healthcheck.DEFAULT_PORTS.items():
        args = importlib.import_module(f"{module}.__main__").parse_args(required.get(module, []))
        assert args.port == port, module


def test_secrets_files_made_once_with_the_demo_key_printed_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    init_secrets.make_files(tmp_path, ["pdserve-cluster", "router"])
    first = capsys.readouterr().out
    (key,) = [line.split("=", 1)[1] for line in first.splitlines() if "PDSERVE_API_KEY=" in line]
    keys_file = tmp_path / "api-keys.yaml"
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    init_secrets.make_files(tmp_path, ["pdserve-cluster", "router"])
    assert key not in capsys.readouterr().out  # shown once
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # kept
    assert key not in keys_file.read_text()  # held as its digest only
    assert ApiKeys.from_file(keys_file).tenant_of(key) == "demo"
    password = (tmp_path / "redis-password").read_text().strip()
    assert (tmp_path / "redis.conf").read_text().splitlines() == [
        f"requirepass {password}",
        f"masterauth {password}",
    ]
    for secret in ("api-keys.yaml", "redis-password", "redis.conf", "tls/node.key"):
        assert (tmp_path / secret).stat().st_mode & 0o077 == 0, secret
    names = x509.load_pem_x509_certificate((tmp_path / "tls/node.pem").read_bytes()).extensions
    dns = names.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"pdserve-cluster", "router"} <= set(dns.get_values_for_type(x509.DNSName))


class _ApiServer(BaseHTTPRequestHandler):
    """POST /api/v1/namespaces/NS/secrets as the API answers it: 201, or 409 for a name
    that exists; 401 without the token."""

    secrets: dict[str, dict[str, Any]]
    token = "sa-token"

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.headers["Authorization"] != f"Bearer {self.token}":
            code = 401
        elif self.path != "/api/v1/namespaces/ml/secrets" or body["kind"] != "Secret":
            code = 404
        elif body["metadata"]["name"] in self.secrets:
            code = 409
        else:
            self.secrets[body["metadata"]["name"]] = body
            code = 201
        self.send_response(code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api_server(certs: ClusterCerts) -> Iterator[tuple[str, dict[str, dict[str, Any]]]]:
    stored: dict[str, dict[str, Any]] = {}
    handler = type("Handler", (_ApiServer,), {"secrets": stored})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.node_cert, certs.node_key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", stored
    finally:
        server.shutdown()
        thread.join()


def test_kubernetes_secrets_created_once_each(
    tmp_path: Path,
    certs: ClusterCerts,
    api_server: tuple[str, dict[str, dict[str, Any]]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    import base64

    url, stored = api_server
    (tmp_path / "token").write_text("sa-token\n")
    template = (
        "redis+sentinel://:{password}@redis-0.redis:26379/pdserve/0?sentinel_password={password}"
    )
    argv = [
        "kubernetes",
        "--service",
        "router",
        "--host",
        "pdserve-cluster",
        "--namespace",
        "ml",
        "--redis-url-template",
        template,
        "--api-server",
        url,
        "--token-file",
        str(tmp_path / "token"),
        "--ca-file",
        str(certs.ca),
    ]
    args: argparse.Namespace = init_secrets.parser().parse_args(argv)
    init_secrets.make_kubernetes(args)
    assert capsys.readouterr().out.count(": created") == 4
    assert set(stored) == {"pdserve-tls", "pdserve-api-keys", "pdserve-redis", "pdserve-redis-url"}
    data = {
        name: {k: base64.b64decode(v).decode() for k, v in s["data"].items()}
        for name, s in stored.items()
    }
    assert set(data["pdserve-tls"]) == set(init_secrets.TLS_FILES)
    node = x509.load_pem_x509_certificate(data["pdserve-tls"]["node.pem"].encode())
    san = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"router", "router.ml.svc", "router.ml.svc.cluster.local", "pdserve-cluster"} <= set(
        san.get_values_for_type(x509.DNSName)
    )
    redis = data["pdserve-redis"]
    url = data["pdserve-redis-url"]["PDSERVE_REDIS_URL"]
    assert url == template.replace("{password}", redis["password"])
    assert f"requirepass {redis['password']}" in redis["redis.conf"]
    keys = data["pdserve-api-keys"]
    (tmp_path / "keys.yaml").write_text(keys["api-keys.yaml"])
    assert ApiKeys.from_file(tmp_path / "keys.yaml").tenant_of(keys["demo-key"]) == "demo"
    first = dict(stored)
    init_secrets.make_kubernetes(args)  # the Job again: everything kept
    assert capsys.readouterr().out.count("exists, kept") == 4 and stored == first
    (tmp_path / "token").write_text("wrong\n")
    with pytest.raises(SystemExit, match="HTTP 401"):
        init_secrets.make_kubernetes(args)
