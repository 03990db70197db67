"""The client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio) for the Router service.

::

    from pdserve.client import AsyncClient, Client

    with Client("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_tokens=16, temperature=0).text)
        for delta in client.stream("Once upon a time", max_tokens=32):
            print(delta.text, end="", flush=True)
            if delta.text.endswith("."):
                break  # cancels the request at once: the worker stops generating

    async with AsyncClient("127.0.0.1:50051") as client:
        async with client.stream("Once upon a time", max_tokens=32) as stream:
            async for delta in stream:
                if delta.text.endswith("."):
                    break  # leaving the block cancels the request at once

Errors are typed (``InvalidRequest``, ``Overloaded``, ``DeadlineExceeded``, ``Unavailable``,
``Unauthenticated``, all ``PdServeClientError``), each with the gRPC ``code`` and ``message``.
Several routers: ``Client("10.0.0.1:50051,10.0.0.2:50051")`` (or ``dns:///NAME:PORT``)
spreads calls over them and skips one that is down (``channel_target``).
UNAVAILABLE is retried (bounded, with backoff) as long as no token has arrived. A prompt over
the router's limits is ``InvalidRequest`` naming the field (``text``, ``token_ids``) and the
limit; one so large that gRPC refuses the message unparsed is ``RequestTooLarge``, an
``InvalidRequest`` too (never ``Overloaded``: no retry can succeed).

Every call has a deadline: ``DEFAULT_TIMEOUT_S`` (60 s) unless the client or the call says
otherwise. It bounds the whole call, retries and every streamed token included, so a stalled
server costs at most that long. ``Client(address, timeout=None)`` makes calls without a limit.

A secured router (``docs/security.md``): ``api_key="..."`` sends the key on every call (a
call's own ``api_key=`` overrides it for that call), and
``tls=TlsConfig(ca=Path("ca.pem"))`` (or ``tls=True`` for a certificate of a public CA) speaks
TLS; ``TlsConfig(ca=..., cert=..., key=...)`` also presents a client certificate (mutual TLS).
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Sequence
from typing import Any, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client.convert import completion_from_proto, model_info_from_proto
from pdserve.client.errors import error_from_rpc
from pdserve.client.request import (
    DEFAULT_TIMEOUT_S,
    RequestOptions,
    RetryPolicy,
    build_request,
    check_timeout,
    metadata,
)
from pdserve.client.results import Completion, ModelInfo
from pdserve.client.stream import AsyncCompletionStream, CompletionStream, Deadline
from pdserve.errors import InvalidArgumentError
from pdserve.rpc.sizes import MAX_MESSAGE_BYTES
from pdserve.security.tls import TlsConfig
from pdserve.v1 import router_pb2, router_pb2_grpc

CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    # gRPC sends any size by default; a request over what the router could ever receive is
    # refused here, before it is sent (``RequestTooLarge``).
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A router restarted on its address is reached again within a second (gRPC's default
    # reconnect backoff grows to two minutes), in time for the retries of UNAVAILABLE.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def channel_target(address: str) -> tuple[str, list[tuple[str, Any]]]:
    """The gRPC target of ``address`` and the channel options it needs.

    One ``HOST:PORT`` is used as it is. Several routers, ``IP:PORT,IP:PORT,...`` (IP literals,
    as behind no load balancer), become one channel that spreads calls over them
    (``round_robin``) and skips one that is down: a router's death then costs only the calls
    it had open. For a DNS name with several addresses, use ``dns:///NAME:PORT`` (also
    ``round_robin``)."""
    if "," not in address and not address.startswith("dns:"):
        return address, []
    balanced = [("grpc.lb_policy_name", "round_robin")]
    if address.startswith("dns:"):
        return address, balanced
    hosts = [a.strip() for a in address.split(",") if a.strip()]
    v6 = [h.startswith("[") for h in hosts]
    for h in hosts:
        host = h.rpartition(":")[0].strip("[]")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise InvalidArgumentError(
                "address",
                f"{h!r}: a list of routers takes IP:PORT entries; for a DNS name with several "
                "addresses use dns:///NAME:PORT",
            ) from None
    if any(v6) and not all(v6):
        raise InvalidArgumentError("address", "a list of routers is all IPv4 or all IPv6")
    return f"{'ipv6' if all(v6) else 'ipv4'}:{','.join(hosts)}", balanced


def _tls(tls: TlsConfig | bool) -> TlsConfig | None:
    if tls is True:
        return TlsConfig()  # the system's CA roots
    return tls or None


class _Base:
    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        tenant: str | None = None,
        retry: RetryPolicy | None = None,
        api_key: str | None = None,
        tls: TlsConfig | bool = False,
    ) -> None:
        """``api_key``: sent as ``authorization: Bearer KEY``; ``tls``: see the module doc."""
        self.address = address
        self._target, self._balancing = channel_target(address)
        self.timeout = check_timeout(timeout)
        """Default deadline of a call in seconds, streams included (None: no limit)."""
        self.tenant = tenant
        """Default tenant, sent as the ``x-pdserve-tenant`` metadata (a router with API keys
        ignores it: the key names the tenant)."""
        self.retry = retry or RetryPolicy()
        self._api_key = api_key
        self.tls = _tls(tls)
        """TLS settings of the channel; None: plaintext."""
        self._connect()

    def _connect(self) -> None:
        """Open the channel (a blocking client: at once; an asyncio one waits for its loop)."""

    def _channel_args(self) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
        options = [*CHANNEL_OPTIONS, *self._balancing]
        if self.tls is None:
            return None, options
        return self.tls.channel_credentials(), [*options, *self.tls.channel_options()]

    def _prepare(
        self,
        prompt: str | Sequence[int],
        timeout: float | None,
        tenant: str | None,
        options: RequestOptions,
        api_key: str | None,
    ) -> tuple[router_pb2.GenerateRequest, Deadline, tuple[tuple[str, str], ...]]:
        request = build_request(prompt, **options)
        deadline = Deadline(self.timeout if timeout is None else check_timeout(timeout))
        md = metadata(
            tenant if tenant is not None else self.tenant,
            api_key if api_key is not None else self._api_key,
        )
        return request, deadline, md

    def _info_call(
        self, timeout: float | None, api_key: str | None
    ) -> tuple[float | None, tuple[tuple[str, str], ...]]:
        left = self.timeout if timeout is None else check_timeout(timeout)
        return left, metadata(self.tenant, api_key if api_key is not None else self._api_key)


class Client(_Base):
    """A blocking client of one router; thread-safe, reuse it (one channel for all calls)."""

    def _connect(self) -> None:
        creds, options = self._channel_args()
        self._channel = (
            grpc.secure_channel(self._target, creds, options=options)
            if creds is not None
            else grpc.insecure_channel(self._target, options=options)
        )
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        timeout: float | None = None,
        tenant: str | None = None,
        api_key: str | None = None,
        **options: Unpack[RequestOptions],
    ) -> Completion:
        """Generate a completion of ``prompt`` (text, or token ids) and wait for all of it.

        ``options``: sampling parameters, stop conditions and request id (``RequestOptions``);
        unset ones take the server's defaults (temperature 1, max_tokens 16); ``temperature=0``
        is greedy. ``timeout`` (seconds), ``tenant`` and ``api_key`` override the client's
        defaults for this call (a front end serving many callers sends each caller's key);
        None takes the client's.
        """
        request, deadline, md = self._prepare(prompt, timeout, tenant, options, api_key)
        attempt = 0
        while True:
            attempt += 1
            try:
                response = self._stub.GenerateUnary(
                    request, timeout=deadline.remaining(), metadata=md
                )
                return completion_from_proto(response)
            except grpc.RpcError as err:
                delay = self.retry.should_retry(
                    err.code(), attempt, started=False, time_left_s=deadline.remaining()
                )
                if delay is None:
                    raise error_from_rpc(err) from err
            time.sleep(delay)  # retry backoff

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        timeout: float | None = None,
        tenant: str | None = None,
        api_key: str | None = None,
        **options: Unpack[RequestOptions],
    ) -> CompletionStream:
        """Like ``generate``, but yields ``Delta``s as tokens are produced."""
        request, deadline, md = self._prepare(prompt, timeout, tenant, options, api_key)
        return CompletionStream(
            lambda left: self._stub.Generate(request, timeout=left, metadata=md),
            self.retry,
            deadline,
        )

    def model_info(self, *, timeout: float | None = None, api_key: str | None = None) -> ModelInfo:
        """What the router serves (lengths) and the caller's tenant. A router with API keys
        answers only a call with a valid key (else ``Unauthenticated``), so this also checks
        a key. Not retried."""
        left, md = self._info_call(timeout, api_key)
        try:
            reply = self._stub.GetModelInfo(
                router_pb2.GetModelInfoRequest(), timeout=left, metadata=md
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
        return model_info_from_proto(reply)

    def close(self) -> None:
        """Close the channel; calls still running are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """An asyncio client of one router. Use it from one event loop; ``await close()`` at the end
    (or ``async with``)."""

    # Created on first use, inside the event loop that will drive it.
    _channel: grpc.aio.Channel | None = None
    _stub: router_pb2_grpc.RouterStub | None = None

    def _get_stub(self) -> router_pb2_grpc.RouterStub:
        if self._stub is None:
            creds, options = self._channel_args()
            self._channel = (
                grpc.aio.secure_channel(self._target, creds, options=options)
                if creds is not None
                else grpc.aio.insecure_channel(self._target, options=options)
            )
            self._stub = router_pb2_grpc.RouterStub(self._channel)
        return self._stub

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        timeout: float | None = None,
        tenant: str | None = None,
        api_key: str | None = None,
        **options: Unpack[RequestOptions],
    ) -> Completion:
        """See ``Client.generate``."""
        request, deadline, md = self._prepare(prompt, timeout, tenant, options, api_key)
        stub = self._get_stub()
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await stub.GenerateUnary(
                    request, timeout=deadline.remaining(), metadata=md
                )
                return completion_from_proto(response)
            except grpc.RpcError as err:
                delay = self.retry.should_retry(
                    err.code(), attempt, started=False, time_left_s=deadline.remaining()
                )
                if delay is None:
                    raise error_from_rpc(err) from err
            await asyncio.sleep(delay)  # retry backoff

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        timeout: float | None = None,
        tenant: str | None = None,
        api_key: str | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncCompletionStream:
        """See ``Client.stream``: ``async for delta in client.stream(...)``."""
        request, deadline, md = self._prepare(prompt, timeout, tenant, options, api_key)
        stub = self._get_stub()
        return AsyncCompletionStream(
            lambda left: stub.Generate(request, timeout=left, metadata=md),
            self.retry,
            deadline,
        )

    async def model_info(
        self, *, timeout: float | None = None, api_key: str | None = None
    ) -> ModelInfo:
        """See ``Client.model_info``."""
        left, md = self._info_call(timeout, api_key)
        try:
            reply = await self._get_stub().GetModelInfo(
                router_pb2.GetModelInfoRequest(), timeout=left, metadata=md
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
        return model_info_from_proto(reply)

    async def health(self, timeout: float = 2.0) -> bool:
        """True when the router's gRPC health check says SERVING (False when it says anything
        else or cannot be reached within ``timeout`` seconds)."""
        self._get_stub()
        assert self._channel is not None  # made by _get_stub
        check = health_pb2_grpc.HealthStub(self._channel).Check
        try:
            reply = await check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        """Close the channel; calls still running are cancelled."""
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
