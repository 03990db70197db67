"""Where a pdserve service finds Redis: one URL, a plain server or a Sentinel-watched master.

::

    redis://[[USER]:PASSWORD@]HOST:PORT/DB            one server (rediss://: TLS)
    redis+sentinel://[[USER]:PASSWORD@]S1[:P1],S2[:P2],.../SERVICE[/DB][?OPTIONS]
    rediss+sentinel://...                             the same, TLS to the master

With Sentinel the client asks the sentinels (default port 26379) for the current master of
``SERVICE`` and asks again whenever a connection to it fails or the server it reaches has
become a replica, so a Redis failover costs the services a few retried commands, not a
restart. The credentials in the URL are the master's (its ``requirepass``/ACL user);
``?sentinel_password=...`` (and ``sentinel_username``) authenticate to the sentinels
themselves, which usually have a password of their own. Other options are the TLS ones of
``rediss://`` (``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``), applied to the master.

Why WATCH still holds across a failover: a transaction's WATCH lives on one connection; when
the master dies that connection fails, the transaction fails (the scheduler's optimistic
re-check retries it from a fresh read), and the retry runs on the new master.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.sentinel import Sentinel

from pdserve.errors import InvalidArgumentError

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DIRECT_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_PORT = 26379
_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
_SENTINEL_OPTIONS = ("sentinel_password", "sentinel_username")


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """A master watched by Sentinel (see the module docstring for the URL)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False
    tls_options: dict[str, str] = field(default_factory=dict)


def is_sentinel(url: str) -> bool:
    return urllib.parse.urlsplit(url).scheme in SENTINEL_SCHEMES


def parse_sentinel(url: str, what: str = "redis_url") -> SentinelTarget:
    """The Sentinel target of a ``redis+sentinel://`` URL; InvalidArgumentError naming
    ``what`` (the flag or field that carried it) when the URL is malformed."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        raise InvalidArgumentError(what, f"not a Sentinel URL (scheme {parts.scheme!r})")
    auth, _, hosts = parts.netloc.rpartition("@")
    username, _, password = auth.partition(":")
    sentinels = tuple(_host_port(h, what) for h in hosts.split(",") if h)
    if not sentinels:
        raise InvalidArgumentError(what, "a Sentinel URL names at least one sentinel host")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise InvalidArgumentError(what, "a Sentinel URL's path is /SERVICE or /SERVICE/DB")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise InvalidArgumentError(what, f"database {path[1]!r} is not a number")
        db = int(path[1])
    query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(query) - set(_TLS_OPTIONS) - set(_SENTINEL_OPTIONS))
    if unknown:
        known = ", ".join(_SENTINEL_OPTIONS + _TLS_OPTIONS)
        raise InvalidArgumentError(what, f"unknown option(s) {', '.join(unknown)}; known: {known}")
    tls = parts.scheme == "rediss+sentinel"
    tls_options = {k: v for k, v in query.items() if k in _TLS_OPTIONS}
    if tls_options and not tls:
        raise InvalidArgumentError(what, "TLS options need the rediss+sentinel:// scheme")
    return SentinelTarget(
        sentinels=sentinels,
        service=urllib.parse.unquote(path[0]),
        db=db,
        username=urllib.parse.unquote(username) or None,
        password=urllib.parse.unquote(password) or None,
        sentinel_username=query.get("sentinel_username") or None,
        sentinel_password=query.get("sentinel_password") or None,
        tls=tls,
        tls_options=tls_options,
    )


def check_redis_url(url: str, what: str = "redis_url") -> None:
    """Refuse a URL no pdserve Redis client could use, naming ``what``."""
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme in SENTINEL_SCHEMES:
        parse_sentinel(url, what)
    elif scheme not in DIRECT_SCHEMES:
        allowed = ", ".join(f"{s}://" for s in DIRECT_SCHEMES + SENTINEL_SCHEMES)
        raise InvalidArgumentError(what, f"unsupported scheme {scheme!r}; use {allowed}")


def redacted(url: str) -> str:
    """``url`` with its passwords (``redis://user:PASSWORD@host``, ``sentinel_password=``)
    replaced by ``***``, for logs."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    auth, at, hosts = netloc.rpartition("@")
    if at and ":" in auth:
        netloc = f"{auth.partition(':')[0]}:***@{hosts}"
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    hidden = [(k, "***" if k == "sentinel_password" else v) for k, v in query]
    return urllib.parse.urlunsplit(
        parts._replace(netloc=netloc, query=urllib.parse.urlencode(hidden, safe="*/"))
    )


def _host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, SENTINEL_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(what, f"sentinel {text!r}: port must be 1-65535")
    return host.strip("[]"), int(port)


def client_for(
    url: str, options: Mapping[str, Any], *, redis_class: Any, sentinel_class: Any
) -> Any:
    """A ``redis_class`` client of the master at ``url`` with connection ``options``: straight
    from the URL, or through ``sentinel_class`` (the asyncio or the sync one, alike in
    signature) for a Sentinel URL. The sentinels get the same socket timeouts."""
    check_redis_url(url)
    if not is_sentinel(url):
        return redis_class.from_url(url, **options)
    target = parse_sentinel(url)
    timeouts = {k: v for k, v in options.items() if k.startswith("socket_")}
    sentinel = sentinel_class(
        list(target.sentinels),
        sentinel_kwargs={
            "username": target.sentinel_username,
            "password": target.sentinel_password,
            **timeouts,
        },
    )
    tls = {"ssl": True, **target.tls_options} if target.tls else {}
    return sentinel.master_for(
        target.service,
        redis_class=redis_class,
        db=target.db,
        username=target.username,
        password=target.password,
        **options,
        **tls,
    )


def sync_client(url: str, *, timeout_s: float = 2.0) -> redis.Redis:
    """A plain synchronous client of the master at ``url`` (tools and tests; the services use
    ``registry.connect``'s asyncio one)."""
    options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    client: redis.Redis = client_for(url, options, redis_class=redis.Redis, sentinel_class=Sentinel)
    return client
