"""Certificates for the security tests: one cluster's set, and a stranger's (another CA)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.security.certs import ClusterCerts, make_certs


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    """A second, unrelated CA and its certificates (a stranger's)."""
    return make_certs(tmp_path_factory.mktemp("other-certs"))


@pytest.fixture
def token(certs: ClusterCerts) -> str:
    return certs.token.read_text().strip()


def pem_files(certs: ClusterCerts) -> list[Path]:
    return [certs.ca, certs.node_cert, certs.client_cert]
