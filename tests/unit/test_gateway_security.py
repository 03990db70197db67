"""The gateway's security pieces without a cluster: the caller's key from the HTTP header, the
401/403 of the router's refusals, and the TLS flags (files checked at start, naming the flag).
``tests/integration/test_gateway_security.py`` runs them in a secured cluster."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from starlette.requests import Request

from pdserve.client import PermissionDenied, Unauthenticated
from pdserve.gateway.app import api_key_of
from pdserve.gateway.errors import GatewayError, from_client_error
from pdserve.security.certs import ClusterCerts, make_certs
from services.gateway.__main__ import parse_args


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    return make_certs(tmp_path_factory.mktemp("gateway-certs"))


def request_with(*headers: tuple[bytes, bytes]) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": list(headers)})


def test_the_key_comes_from_the_bearer_header() -> None:
    assert api_key_of(request_with((b"authorization", b"Bearer k-abc"))) == "k-abc"
    assert api_key_of(request_with((b"authorization", b"bearer  k-abc "))) == "k-abc"
    for headers in [(), ((b"authorization", b"Bearer "),), ((b"authorization", b"Basic x"),)]:
        assert api_key_of(request_with(*headers)) is None
    # gRPC metadata carries printable ASCII only: anything else is refused here, as a bad key.
    for raw in (b"Bearer k-\xe9t\xe9", b"Bearer k-a\x7fb"):
        with pytest.raises(GatewayError) as refused:
            api_key_of(request_with((b"authorization", raw)))
        assert refused.value.status.http == 401 and refused.value.code == "invalid_api_key"


def test_router_refusals_are_401_and_403() -> None:
    refused = Unauthenticated(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required")
    missing = from_client_error(refused, prompt_param="prompt", api_key_sent=False)
    wrong = from_client_error(refused, prompt_param="prompt", api_key_sent=True)
    for err in (missing, wrong):
        body = err.body().model_dump()["error"]
        assert err.status.http == 401
        assert (body["type"], body["code"]) == ("invalid_request_error", "invalid_api_key")
    assert "didn't provide an API key" in missing.message
    assert missing.message != wrong.message
    denied = from_client_error(
        PermissionDenied(grpc.StatusCode.PERMISSION_DENIED, "not yours"), prompt_param="prompt"
    )
    assert (denied.status.http, denied.status.type) == (403, "permission_error")
    assert (denied.code, denied.message) == ("permission_denied", "not yours")


BASE = ["--router", "127.0.0.1:1", "--model", "m"]


def test_tls_flags(certs: ClusterCerts) -> None:
    plain = parse_args(BASE).tls
    assert (plain.https, plain.router, plain.scheme) == (False, None, "http")
    tls = parse_args(
        [*BASE, "--tls-cert", str(certs.node_cert), "--tls-key", str(certs.node_key),
         "--router-tls-ca", str(certs.ca), "--router-tls-cert", str(certs.client_cert),
         "--router-tls-key", str(certs.client_key)]
    ).tls  # fmt: skip
    assert tls.scheme == "https" and tls.router is not None
    assert (tls.router.ca, tls.router.cert, tls.router.key) == (
        certs.ca,
        certs.client_cert,
        certs.client_key,
    )
    system_roots = parse_args([*BASE, "--router-tls"]).tls.router
    assert system_roots is not None and system_roots.ca is None and system_roots.calling is False


def test_tls_flags_default_to_the_environment(
    certs: ClusterCerts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_ROUTER_TLS_CA", str(certs.ca))
    monkeypatch.setenv("PDSERVE_TLS_CERT", str(certs.node_cert))
    monkeypatch.setenv("PDSERVE_TLS_KEY", str(certs.node_key))
    tls = parse_args(BASE).tls
    assert tls.router is not None and tls.router.ca == certs.ca and tls.cert == certs.node_cert


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--tls-cert", "{node}"], "--tls-key"),
        (["--router-tls-cert", "{client}"], "--router-tls-key"),
        (["--router-tls-ca", "{missing}"], "--router-tls-ca"),
        (["--router-tls-ca", "{key}"], "--router-tls-ca"),  # not a certificate: no BEGIN
        (["--tls-cert", "{client}", "--tls-key", "{node_key}"], "--tls-cert"),  # not its key
    ],
)
def test_bad_tls_flags_are_named(
    certs: ClusterCerts, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    flags: list[str], named: str,
) -> None:  # fmt: skip
    (tmp_path / "plain.txt").write_text("no pem here")
    paths = {"node": certs.node_cert, "client": certs.client_cert, "node_key": certs.node_key,
             "missing": tmp_path / "nope.pem", "key": tmp_path / "plain.txt"}  # fmt: skip
    with pytest.raises(SystemExit) as exited:
        parse_args([*BASE, *(f.format(**{k: str(v) for k, v in paths.items()}) for f in flags)])
    assert exited.value.code == 2
    assert f"error: {named}:" in capsys.readouterr().err
