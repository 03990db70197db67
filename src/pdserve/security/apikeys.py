"""API keys of the router's clients: which key belongs to which tenant, and tenants' quotas.

The keys file (YAML, or JSON, which YAML reads too)::

    keys:                                   # API key -> tenant
      "k-3f9c2e...": acme
      "sha256:5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8": globex
    tenants:                                # optional quotas (scheduler)
      acme: {max_reservations: 8, max_kv_blocks: 4096}
    default_quota: {max_reservations: 16}   # optional: every tenant not listed

A key may be given as ``sha256:HEX`` (its SHA-256 in hex), so that the file holds no usable
secret. Clients send ``authorization: Bearer KEY``. The router admits a call only with a key
of the file, and the call's tenant is the key's: what the request says (``tenant``, the
``x-pdserve-tenant`` metadata) is ignored. The scheduler reads the same file for the quotas
(``pdserve.quotas``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdserve.errors import InvalidArgumentError
from pdserve.quotas import TenantQuota, TenantQuotas
from pdserve.security.auth import Metadata, bearer

_SHA256 = "sha256:"
_MIN_KEY_CHARS = 16


def key_digest(key: str) -> str:
    """The hex SHA-256 of an API key (how keys are held and may be written in the file)."""
    return hashlib.sha256(key.encode()).hexdigest()


def _quota(value: Any, where: str) -> TenantQuota:
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(where, "must be a mapping of max_reservations/max_kv_blocks")
    unknown = set(value) - {"max_reservations", "max_kv_blocks"}
    if unknown:
        raise InvalidArgumentError(where, f"unknown quota fields {sorted(unknown)}")
    try:
        return TenantQuota(**{str(k): v for k, v in value.items()})
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"{where}.{err.field}", str(err).split(": ", 1)[-1]) from err


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """Key digests -> tenant, and the tenants' quotas (see the module docstring)."""

    tenants_by_digest: Mapping[str, str] = field(repr=False)
    quotas: TenantQuotas = field(default_factory=TenantQuotas)

    @classmethod
    def parse(cls, data: Any, source: str = "api keys") -> ApiKeys:
        if not isinstance(data, Mapping) or not isinstance(data.get("keys"), Mapping):
            raise InvalidArgumentError(source, "expected a mapping with a 'keys' mapping")
        unknown = set(data) - {"keys", "tenants", "default_quota"}
        if unknown:
            raise InvalidArgumentError(source, f"unknown sections {sorted(unknown)}")
        by_digest: dict[str, str] = {}
        for key, tenant in data["keys"].items():
            if not isinstance(key, str) or not isinstance(tenant, str) or not tenant:
                raise InvalidArgumentError(f"{source}.keys", "each key maps to a tenant name")
            if key.startswith(_SHA256):
                digest = key[len(_SHA256) :].lower()
                if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                    raise InvalidArgumentError(f"{source}.keys", "sha256: needs 64 hex digits")
            elif len(key) < _MIN_KEY_CHARS:
                raise InvalidArgumentError(
                    f"{source}.keys", f"a key of tenant {tenant!r} is shorter than 16 characters"
                )
            else:
                digest = key_digest(key)
            by_digest[digest] = tenant
        tenants = data.get("tenants") or {}
        if not isinstance(tenants, Mapping):
            raise InvalidArgumentError(f"{source}.tenants", "must map tenant names to quotas")
        per_tenant = {
            str(name): _quota(q, f"{source}.tenants.{name}") for name, q in tenants.items()
        }
        default = data.get("default_quota")
        quotas = TenantQuotas(
            _quota(default, f"{source}.default_quota") if default is not None else TenantQuota(),
            per_tenant,
        )
        return cls(by_digest, quotas)

    @classmethod
    def from_file(cls, path: Path) -> ApiKeys:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise InvalidArgumentError("--api-keys", f"cannot read {path}: {err}") from err
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise InvalidArgumentError("--api-keys", f"{path} is not YAML or JSON: {err}") from err
        return cls.parse(data, source=f"--api-keys {path}")

    def tenant_of(self, key: str | None) -> str | None:
        """The tenant of ``key``; None for no key or an unknown one."""
        if not key:
            return None
        return self.tenants_by_digest.get(key_digest(key))

    # -- the Authenticator protocol (``pdserve.security.auth``) --------------------------------

    def admits(self, metadata: Metadata | None) -> bool:
        return self.tenant_of(bearer(metadata)) is not None

    @property
    def checks_peer(self) -> bool:
        return False

    def admits_peer(self, auth_context: Mapping[str, Iterable[bytes]]) -> bool:
        return False

    def refusal(self) -> str:
        return "a valid API key is required (metadata 'authorization: Bearer KEY')"
