"""The API keys file, the internal token's sources, and ``pdserve certs``'s files."""

from __future__ import annotations

import json
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.cli import main as cli_main
from pdserve.errors import InvalidArgumentError
from pdserve.quotas import TenantQuota
from pdserve.security.apikeys import ApiKeys, key_digest
from pdserve.security.auth import bearer, bearer_metadata, load_token
from pdserve.security.certs import ClusterCerts
from pdserve.security.up import how_to_call

KEY_A = "ka-0123456789abcdef"
KEY_B = "kb-fedcba9876543210"


def test_keys_map_to_tenants_and_quotas(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(
        f'keys:\n  "{KEY_A}": acme\n  "sha256:{key_digest(KEY_B)}": globex\n'
        "tenants:\n  acme: {max_reservations: 2, max_kv_blocks: 64}\n"
        "default_quota: {max_reservations: 5}\n"
    )
    keys = ApiKeys.from_file(path)
    assert keys.tenant_of(KEY_A) == "acme"
    assert keys.tenant_of(KEY_B) == "globex"  # given by its digest only
    assert keys.tenant_of(KEY_A + "x") is None and keys.tenant_of("") is None
    assert keys.tenant_of(None) is None
    assert keys.quotas.of("acme") == TenantQuota(max_reservations=2, max_kv_blocks=64)
    assert keys.quotas.of("globex") == TenantQuota(max_reservations=5)
    assert keys.admits([bearer_metadata(KEY_A)]) and not keys.admits([("authorization", KEY_A)])
    assert KEY_A not in repr(keys)


def test_keys_file_may_be_json(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": {KEY_A: "acme"}}))
    assert ApiKeys.from_file(path).tenant_of(KEY_A) == "acme"


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"keys": {"short": "acme"}}, "keys"),
        ({"keys": {KEY_A: ""}}, "keys"),
        ({"keys": {"sha256:abc": "acme"}}, "keys"),
        ({"keys": {KEY_A: "acme"}, "extra": 1}, "api keys"),
        ({"keys": {KEY_A: "acme"}, "tenants": {"acme": {"max_reservations": -1}}}, "acme"),
        ({"keys": {KEY_A: "acme"}, "tenants": {"acme": {"max_seqs": 3}}}, "acme"),
        ([KEY_A], "api keys"),
    ],
)
def test_bad_keys_files_are_refused_naming_the_place(data: object, named: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        ApiKeys.parse(data)
    assert named in err.value.field


def test_bearer_reads_the_authorization_metadata() -> None:
    assert bearer([("x-other", "1"), ("authorization", "Bearer abc")]) == "abc"
    assert bearer([("authorization", "bearer abc ")]) == "abc"
    assert bearer([("authorization", "Basic abc")]) is None
    assert bearer(None) is None


def test_internal_token_from_file_or_environment(tmp_path: Path) -> None:
    file = tmp_path / "token"
    file.write_text("t" * 32 + "\n")
    assert load_token(file, {}) == "t" * 32
    assert load_token(None, {"PDSERVE_INTERNAL_TOKEN_FILE": str(file)}) == "t" * 32
    assert load_token(None, {"PDSERVE_INTERNAL_TOKEN": "e" * 20}) == "e" * 20
    assert load_token(None, {}) is None
    with pytest.raises(InvalidArgumentError, match="at least 16"):
        load_token(None, {"PDSERVE_INTERNAL_TOKEN": "short"})
    with pytest.raises(InvalidArgumentError) as err:
        load_token(tmp_path / "missing", {})
    assert err.value.field == "--internal-token-file"


def test_pdserve_certs_writes_a_private_ca_and_identities(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tls"
    assert cli_main(["certs", str(out), "--host", "10.1.2.3", "--host", "node-7"]) == 0
    certs = ClusterCerts(out)
    assert certs.complete() and "pdserve up --tls" in capsys.readouterr().out
    for secret in (certs.node_key, certs.client_key, out / "ca.key", certs.token):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert len(certs.token.read_text().strip()) == 64

    ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    node = x509.load_pem_x509_certificate(certs.node_cert.read_bytes())
    client = x509.load_pem_x509_certificate(certs.client_cert.read_bytes())
    for cert in (node, client):
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
    cn = node.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert cn == "pdserve-cluster"
    usages = node.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "node-7"} <= set(names.get_values_for_type(x509.DNSName))
    ips = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    assert {"127.0.0.1", "10.1.2.3"} <= ips
    client_usages = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(client_usages) == [ExtendedKeyUsageOID.CLIENT_AUTH]

    # Run again: the set is kept (a running cluster's files do not change under it).
    before = certs.ca.read_bytes()
    assert cli_main(["certs", str(out)]) == 0
    assert certs.ca.read_bytes() == before
    assert cli_main(["certs", str(out), "--force"]) == 0
    assert certs.ca.read_bytes() != before


@dataclass
class _Greeted:
    """The fields of a cluster that ``pdserve up``'s greeting reads."""

    certs: ClusterCerts | None
    log_dir: Path
    redis_url: str
    router_client_auth: bool = False
    api_keys: Path | None = None


def test_the_greeting_keeps_the_redis_password_off_the_terminal(
    tmp_path: Path, certs: ClusterCerts
) -> None:
    url = "redis://:s3cret-pass@127.0.0.1:6390/0"
    text = how_to_call(_Greeted(certs, tmp_path, url, api_keys=tmp_path / "k"), "127.0.0.1:1")
    assert "s3cret-pass" not in text and f"--tls-ca {certs.ca}" in text
    assert "--api-key" in text and "  pdserve status" in text
    plain = how_to_call(_Greeted(None, tmp_path, "redis://127.0.0.1:6390/0"), "127.0.0.1:1")
    assert "  pdserve status" in plain and "--tls" not in plain
