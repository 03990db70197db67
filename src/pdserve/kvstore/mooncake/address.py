"""``mooncake://`` KV store addresses: where a Mooncake Store's master is, and how this process
joins it.

::

    mooncake://MASTER_HOST:PORT[?metadata=URL&replicas=N&segment=BYTES&buffer=BYTES
                               &protocol=tcp&devices=NAMES]

* ``metadata``: the transfer metadata server; default ``http://MASTER_HOST:8080/metadata``,
  the one ``mooncake_master --enable_http_metadata_server`` serves (``master.MasterProcess``).
* ``replicas``: copies of each object, on distinct segments (default 1).
* ``segment``: bytes of this process's memory it lends to the store (default 256 MiB; 0: a
  pure client that stores nothing itself). Objects live in the lent segments of the cluster's
  processes; a process that stops takes its segment's objects with it.
* ``buffer``: this process's transfer buffer (default 16 MiB).
* ``protocol``: the transfer engine's (``tcp``, or ``rdma`` with ``devices``).

Sizes take ``KiB``, ``MiB`` and ``GiB`` suffixes. Anything else is refused naming the field,
so that a typo never starts a worker on defaults it did not ask for. The address is also what
hand-off handles carry (``KVLocation.address``): a decode worker joins the same store from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from pdserve.errors import InvalidArgumentError

SCHEME = "mooncake://"
DEFAULT_METADATA_PORT = 8080
_UNITS = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_FIELDS = ("metadata", "replicas", "segment", "buffer", "protocol", "devices")


def is_mooncake(address: str) -> bool:
    """Whether ``address`` names a Mooncake Store (else it is a pdserve KV store host:port)."""
    return address.startswith(SCHEME)


def parse_size(field: str, text: str) -> int:
    """``"256MiB"`` -> bytes; refuses anything else naming ``field``."""
    raw = text.strip().lower()
    digits = raw.rstrip("kmgib")
    unit = raw[len(digits) :]
    if not digits.isdigit() or unit not in _UNITS:
        raise InvalidArgumentError(
            field, f"must be bytes with an optional KiB/MiB/GiB, got {text!r}"
        )
    return int(digits) * _UNITS[unit]


@dataclass(frozen=True, slots=True)
class MooncakeAddress:
    """A parsed ``mooncake://`` address (see the module doc)."""

    master: str
    metadata: str
    replicas: int = 1
    segment_bytes: int = 256 << 20
    buffer_bytes: int = 16 << 20
    protocol: str = "tcp"
    devices: str = ""

    @property
    def master_host(self) -> str:
        return self.master.rsplit(":", 1)[0]

    @property
    def master_port(self) -> int:
        return int(self.master.rsplit(":", 1)[1])

    @classmethod
    def parse(cls, address: str, field: str = "kvstore") -> MooncakeAddress:
        if not is_mooncake(address):
            raise InvalidArgumentError(
                field, f"a Mooncake Store is {SCHEME}HOST:PORT, got {address!r}"
            )
        parts = urlsplit(address)
        try:
            host, port = parts.hostname, parts.port
        except ValueError as err:
            raise InvalidArgumentError(field, f"bad master address in {address!r}: {err}") from None
        if not host or port is None or parts.path not in ("", "/"):
            raise InvalidArgumentError(field, f"must be {SCHEME}HOST:PORT[?...], got {address!r}")
        query = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False))
        unknown = sorted(set(query) - set(_FIELDS))
        if unknown:
            raise InvalidArgumentError(
                f"{field}.{unknown[0]}", f"unknown Mooncake option; known: {', '.join(_FIELDS)}"
            )
        replicas_text = query.get("replicas", "1")
        if not replicas_text.isdigit() or int(replicas_text) < 1:
            raise InvalidArgumentError(f"{field}.replicas", f"must be >= 1, got {replicas_text!r}")
        protocol = query.get("protocol", "tcp")
        if protocol not in ("tcp", "rdma"):
            raise InvalidArgumentError(
                f"{field}.protocol", f"must be tcp or rdma, got {protocol!r}"
            )
        buffer_bytes = parse_size(f"{field}.buffer", query.get("buffer", "16MiB"))
        if buffer_bytes < 1 << 20:
            raise InvalidArgumentError(f"{field}.buffer", f"must be >= 1MiB, got {buffer_bytes}")
        metadata = query.get("metadata") or f"http://{host}:{DEFAULT_METADATA_PORT}/metadata"
        if not metadata.startswith(("http://", "etcd://", "P2PHANDSHAKE")):
            raise InvalidArgumentError(
                f"{field}.metadata", f"must be an http:// URL, got {metadata!r}"
            )
        return cls(
            master=f"{host}:{port}",
            metadata=metadata,
            replicas=int(replicas_text),
            segment_bytes=parse_size(f"{field}.segment", query.get("segment", "256MiB")),
            buffer_bytes=buffer_bytes,
            protocol=protocol,
            devices=query.get("devices", ""),
        )
