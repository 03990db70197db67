"""Whether the router admits an HTTP caller, known before the request's body is read.

The router holds the API keys and decides (``docs/security.md``); the gateway holds none. But a
body must not be read, parsed, rendered or tokenized for a caller the router will refuse: that
work would be anyone's to order. So before the body, the gateway asks the router with the
caller's key (``GetModelInfo``, which the router's key check guards like every method) and
answers 401 if it is refused. An admitted key is remembered (as its SHA-256) for ``ttl_s``,
and so is whether the router takes calls without a key (an open router: then any caller is
admitted without asking), or refuses them (then a caller without a key is refused without
asking); a refused key is not remembered, so a key added to the router's file works at its
next request. The router still checks the key of every call: a key remembered
here but removed there is refused by the router at the generation, as before.

The answer also carries the router's limits (``ModelInfo.max_prompt_tokens``), which the
gateway checks a prompt against before sending it.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import grpc

from pdserve.client import AsyncClient, ModelInfo, PdServeClientError
from pdserve.gateway.errors import from_client_error, unauthorized
from pdserve.security.apikeys import key_digest

TTL_S = 30.0
CAPACITY = 4096
"""Admitted keys remembered at most (the least recently used is forgotten first)."""
CHECK_TIMEOUT_S = 10.0
"""Deadline of one ``GetModelInfo`` (or the request's own deadline, if shorter)."""


class Callers:
    """The router's verdict on callers' keys, asked once per key per ``TTL_S``."""

    def __init__(self, client: AsyncClient, timeout_s: float | None) -> None:
        self.client = client
        self.timeout_s = CHECK_TIMEOUT_S if timeout_s is None else min(timeout_s, CHECK_TIMEOUT_S)
        self.asked = 0
        """``GetModelInfo`` calls made so far."""
        self.info: ModelInfo | None = None
        """The router's latest answer."""
        self._open_until = -1.0
        self._closed_until = -1.0
        self._admitted: OrderedDict[str, float] = OrderedDict()
        """Digest of an admitted key -> until when it is taken as admitted."""

    async def admit(self, api_key: str | None) -> ModelInfo:
        """The router's ``ModelInfo`` if it admits ``api_key`` (None: no key); else the
        ``GatewayError`` of its refusal (401 for a missing or refused key)."""
        now = time.monotonic()
        if self.info is not None and now < self._open_until:
            return self.info
        digest = key_digest(api_key) if api_key is not None else None
        if digest is None and now < self._closed_until:
            raise unauthorized(api_key_sent=False)
        if self.info is not None and digest is not None:
            until = self._admitted.get(digest)
            if until is not None and now < until:
                self._admitted.move_to_end(digest)
                return self.info
        self.asked += 1
        try:
            info = await self.client.model_info(timeout=self.timeout_s, api_key=api_key)
        except PdServeClientError as err:
            if digest is None and err.code == grpc.StatusCode.UNAUTHENTICATED:
                self._closed_until = now + TTL_S
            raise from_client_error(err, prompt_param="", api_key_sent=api_key is not None) from err
        self.info = info
        if digest is None:  # the router takes calls without a key
            self._open_until = now + TTL_S
        else:
            self._admitted[digest] = now + TTL_S
            self._admitted.move_to_end(digest)
            while len(self._admitted) > CAPACITY:
                self._admitted.popitem(last=False)
        return info
