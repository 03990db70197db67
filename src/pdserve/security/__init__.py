"""Transport security and caller authentication shared by every service.

* ``tls``: ``TlsConfig``, certificates from PEM files;
* ``auth``: the internal token, ``AuthInterceptor`` and the ``authorization`` metadata;
* ``apikeys``: the router's API keys (key -> tenant) and the tenants' quotas;
* ``options``: ``SecurityOptions``, one set of flags for every service, and the channels and
  ports it builds;
* ``certs``: ``pdserve certs DIR``, a local CA and certificates (imports ``cryptography``;
  imported only by that command and by tests).

``docs/security.md`` describes the threat model and how to run a secured cluster.
"""

from pdserve.security.auth import AuthInterceptor, InternalAuth, bearer, bearer_metadata
from pdserve.security.options import (
    INSECURE,
    SecurityOptions,
    add_security_args,
    security_from_args,
)
from pdserve.security.tls import TlsConfig

__all__ = [
    "INSECURE",
    "AuthInterceptor",
    "InternalAuth",
    "SecurityOptions",
    "TlsConfig",
    "add_security_args",
    "bearer",
    "bearer_metadata",
    "security_from_args",
]
