"""A request's identity across pdserve: the caller's request id within the caller's tenant.

Callers choose their request ids, so two tenants may choose the same one. Everything that
keeps requests by id (the router's requests in flight, the workers' engines and hand-off
registries, KV store keys, shm segment names, reservation records) must therefore keep them
by ``RequestKey``, or one tenant's id would collide with, and disturb, another's request. The
router makes each request's key once, from the tenant it decided (the API key's, or the
request's without keys) and the caller's id, and sends ``RequestKey.scoped_id`` in the
``request_id`` field of every internal message: the services below the router treat that
string as an opaque id, and keying by it is keying by ``(tenant, request_id)``. What the
caller sees (answers, the ``pdserve.request_id`` span attribute) stays its own id.

The encoding, ``{request_id}@{tenant}#{len(tenant)}``: a plain join such as
``f"{tenant}:{request_id}"`` is ambiguous (tenant ``a:b`` with id ``c`` and tenant ``a``
with id ``b:c`` both give ``a:b:c``), and tenants and ids may hold any printable character.
The tenant's length, written last in decimal, says where the tenant starts: a length holds no
``#``, so the last ``#`` ends the tenant, the length before it delimits the tenant, and what
precedes the ``@`` before the tenant is the id. One string decodes one way (``parse``), so two
different keys never share a ``scoped_id``. The caller's id comes first so that whatever
matches request ids by prefix (the workers' ``--fault ...@PREFIX``, a grep of the logs) still
matches on the caller's id.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError

_TENANT_MARK = "@"
"""Between the caller's id and the tenant."""
_LENGTH_MARK = "#"
"""Between the tenant and its length (decimal digits only, so never this mark)."""


@dataclass(frozen=True, slots=True)
class RequestKey:
    """One request, as every component keys it: ``request_id`` within ``tenant`` ("" is a
    tenant like any other)."""

    tenant: str
    request_id: str

    def __post_init__(self) -> None:
        if not self.request_id:
            raise InvalidArgumentError("request_id", "must not be empty")

    @property
    def scoped_id(self) -> str:
        """The id the services below the router get for this request (module docstring)."""
        return f"{self.request_id}{_TENANT_MARK}{self.tenant}{_LENGTH_MARK}{len(self.tenant)}"

    @classmethod
    def parse(cls, scoped_id: str) -> RequestKey | None:
        """The key whose ``scoped_id`` this is; None for a string no key encodes to (an id
        a caller other than the router chose, calling a worker directly)."""
        head, mark, digits = scoped_id.rpartition(_LENGTH_MARK)
        # A length has no more digits than the head's own length has (which also keeps int()
        # away from huge strings); str(int(...)) == digits: ASCII digits, no leading zeros.
        if not mark or not digits.isdecimal() or len(digits) > len(str(len(head))):
            return None
        if str(int(digits)) != digits:
            return None
        cut = len(head) - int(digits)  # where the tenant starts
        if cut < 2 or head[cut - 1] != _TENANT_MARK:  # an id of one character at least
            return None
        return cls(head[cut:], head[: cut - 1])
