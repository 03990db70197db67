"""Who may call a server: the check every server runs before a method's handler.

Two kinds of caller credentials, both as ``authorization: Bearer <secret>`` metadata:

* the cluster's **internal token** (``InternalAuth``): only cluster members (router, scheduler,
  workers, KV store) hold it, and the internal services (Scheduler, KVStore, Prefill, Decode,
  Mixed) refuse every call without it; a caller whose mutual-TLS client certificate names the
  cluster identity is admitted too;
* a client's **API key** at the router (``pdserve.security.apikeys``), which also says which
  tenant the call belongs to.

``AuthInterceptor`` applies an ``Authenticator`` to every method of a server except the
health service (probes carry no credentials). A refused call ends UNAUTHENTICATED before its
handler runs. A call admitted by its metadata runs its handler untouched (no wrapper, nothing
per message); one that can only be admitted by its certificate is checked in a thin wrapper,
as the certificate is visible only from the call's context.
"""

from __future__ import annotations

import hmac
import inspect
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc.aio import ServicerContext

from pdserve.errors import InvalidArgumentError

AUTHORIZATION = "authorization"
_BEARER = "bearer "
EXEMPT_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)
"""Methods callable without credentials: load balancers and probes check health."""
DEFAULT_IDENTITY = "pdserve-cluster"
"""Common name of the client certificates ``pdserve certs`` makes for cluster members."""
ENV_INTERNAL_TOKEN = "PDSERVE_INTERNAL_TOKEN"
ENV_INTERNAL_TOKEN_FILE = "PDSERVE_INTERNAL_TOKEN_FILE"
MIN_TOKEN_CHARS = 16

Metadata = Iterable[tuple[str, str | bytes]]


def bearer(metadata: Metadata | None) -> str | None:
    """The secret of the first ``authorization: Bearer ...`` entry, if any."""
    for key, value in metadata or ():
        if key == AUTHORIZATION:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if text[: len(_BEARER)].lower() == _BEARER:
                return text[len(_BEARER) :].strip()
    return None


def bearer_metadata(secret: str) -> tuple[str, str]:
    """The metadata entry that carries ``secret``."""
    return (AUTHORIZATION, f"Bearer {secret}")


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison (the time taken says nothing about how much matched)."""
    return hmac.compare_digest(given.encode(), expected.encode())


def load_token(path: Path | None, env: Mapping[str, str]) -> str | None:
    """The internal token: from the file ``path`` (or ``$PDSERVE_INTERNAL_TOKEN_FILE``), else
    ``$PDSERVE_INTERNAL_TOKEN``; None when neither is set. A token is at least 16 characters
    (``pdserve certs`` writes 64 hex digits)."""
    named = env.get(ENV_INTERNAL_TOKEN_FILE)
    file = path or (Path(named) if named else None)
    flag = "--internal-token-file"
    if file is not None:
        try:
            token = Path(file).read_text().strip()
        except OSError as err:
            raise InvalidArgumentError(flag, f"cannot read {file}: {err.strerror or err}") from err
    else:
        token = env.get(ENV_INTERNAL_TOKEN, "").strip()
        flag = ENV_INTERNAL_TOKEN
        if not token:
            return None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise InvalidArgumentError(
            flag, f"the token must be at least {MIN_TOKEN_CHARS} characters without spaces"
        )
    return token


def write_secret(path: Path, secret: str) -> None:
    """Write ``secret`` to a new file readable by its owner only (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")


class Authenticator(Protocol):
    """Decides whether a call may run."""

    def admits(self, metadata: Metadata | None) -> bool:
        """From the call's metadata alone."""
        ...

    def admits_peer(self, auth_context: Mapping[str, Iterable[bytes]]) -> bool:
        """From the verified TLS peer (``ServicerContext.auth_context()``)."""
        ...

    @property
    def checks_peer(self) -> bool:
        """Whether ``admits_peer`` can ever be true (else it is not asked)."""
        ...

    def refusal(self) -> str:
        """The details of an UNAUTHENTICATED answer."""
        ...


@dataclass(frozen=True, slots=True)
class InternalAuth:
    """Cluster members: holders of ``token``, or mutual-TLS peers named ``identities``."""

    token: str | None = field(default=None, repr=False)
    identities: frozenset[str] = frozenset()
    """Common names of client certificates admitted (only set when the server checks client
    certificates: ``TlsConfig.client_auth``)."""

    @property
    def enabled(self) -> bool:
        return self.token is not None or bool(self.identities)

    def admits(self, metadata: Metadata | None) -> bool:
        given = bearer(metadata)
        return self.token is not None and given is not None and same_secret(given, self.token)

    @property
    def checks_peer(self) -> bool:
        return bool(self.identities)

    def admits_peer(self, auth_context: Mapping[str, Iterable[bytes]]) -> bool:
        names = {n.decode(errors="replace") for n in auth_context.get("x509_common_name", ())}
        return bool(names & self.identities)

    def refusal(self) -> str:
        return "internal service: the cluster's credential is required"


def _refuse(context: ServicerContext[Any, Any], auth: Authenticator) -> Awaitable[None]:
    return context.abort(grpc.StatusCode.UNAUTHENTICATED, auth.refusal())


def _refused(behavior: Callable[..., Any], auth: Authenticator) -> Callable[..., Any]:
    """A handler that answers UNAUTHENTICATED at once."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            await _refuse(context, auth)
            yield  # pragma: no cover - abort raised

        return stream

    async def call(request: Any, context: ServicerContext[Any, Any]) -> Any:
        await _refuse(context, auth)

    return call


def _peer_checked(behavior: Callable[..., Any], auth: Authenticator) -> Callable[..., Any]:
    """``behavior`` behind a check of the caller's certificate."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            if not auth.admits_peer(context.auth_context()):
                await _refuse(context, auth)
            async for item in behavior(request, context):
                yield item

        return stream

    async def call(request: Any, context: ServicerContext[Any, Any]) -> Any:
        if not auth.admits_peer(context.auth_context()):
            await _refuse(context, auth)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return call


_HANDLER_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Runs ``auth`` before every method but those under ``EXEMPT_PREFIXES`` (see the module
    doc)."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        if self.auth.admits(handler_call_details.invocation_metadata):
            return handler
        wrap = _peer_checked if self.auth.checks_peer else _refused
        for kind in _HANDLER_KINDS:
            behavior = getattr(handler, kind, None)
            if behavior is not None:
                # The handler is a namedtuple in grpc's implementation.
                return handler._replace(**{kind: wrap(behavior, self.auth)})
        return handler


class _Bearer:
    """Adds ``authorization: Bearer <secret>`` to a call's details."""

    def __init__(self, secret: str) -> None:
        self._entry = bearer_metadata(secret)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials,
            details.wait_for_ready,
        )  # fmt: skip


class _BearerUnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _BearerUnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _BearerStreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


class _BearerStreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def bearer_interceptors(secret: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add ``authorization: Bearer <secret>`` to every call of a plaintext
    channel (a TLS channel carries it as call credentials instead). One per kind of call:
    a grpc.aio channel files each interceptor under the first kind it implements."""
    return [
        _BearerUnaryUnary(secret),
        _BearerUnaryStream(secret),
        _BearerStreamUnary(secret),
        _BearerStreamStream(secret),
    ]
