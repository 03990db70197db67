"""What each route of the gateway does, on top of the SDK's ``AsyncClient`` (no HTTP here).

``Gateway.admit`` asks whether the router admits the caller's key (``callers``), before the
body is read. ``Gateway.completions`` and ``Gateway.chat`` (``completions``, ``chats``) take
the body's bytes, prepare them (``prepare``: parsed, checked, a chat prompt rendered and
tokenized; on a worker thread for a large body, ``pool``), turn them into router requests
(``generation``), and return either a whole response object or, for ``stream: true``, an async
iterator of Server-Sent Events lines ending in ``data: [DONE]``. ``api_key`` is the HTTP
caller's key, sent with each of the request's router calls (the router checks it and takes
the tenant from it; the gateway holds no keys). Errors raise ``GatewayError`` with the HTTP
status and the OpenAI parameter at fault. ``tokenize``, ``detokenize`` and ``model`` are
vLLM's utility routes (``utility``), answered with the gateway's own tokenizer after the key.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from pdserve.client import AsyncClient, ModelInfo, PdServeClientError
from pdserve.gateway import chats, utility
from pdserve.gateway import completions as completion_api
from pdserve.gateway.callers import Callers
from pdserve.gateway.calls import Watch
from pdserve.gateway.chat import ChatTemplate
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import from_client_error
from pdserve.gateway.pool import WorkPool
from pdserve.gateway.prepare import Preparer
from pdserve.gateway.responses import (
    ChatCompletion,
    Completion,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from pdserve.gateway.served import Served
from pdserve.router.request import ModelLimits
from pdserve.tokenizer import Tokenizer

__all__ = ["Gateway", "GatewayConfig"]


class Gateway:
    """The OpenAI endpoints of one model served by one router."""

    def __init__(
        self,
        config: GatewayConfig,
        client: AsyncClient,
        tokenizer: Tokenizer,
        limits: ModelLimits,
        template: ChatTemplate,
    ) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.template = template
        self.created = int(time.time())
        self.callers = Callers(client, config.timeout_s)
        self.pool = WorkPool(config.parse_threads)
        names = (config.model_name, str(config.model_dir))
        self.preparer = Preparer(
            names, tokenizer, limits, template, allow_unknown_fields=config.allow_unknown_fields
        )
        self.served = Served(
            config, client, tokenizer, self.preparer, self.pool, self.callers, self.created
        )

    @classmethod
    def load(cls, config: GatewayConfig) -> Gateway:
        """Read the checkpoint's tokenizer, limits and chat template (no weights)."""
        return cls(
            config,
            AsyncClient(config.router, timeout=config.timeout_s, tls=config.router_tls or False),
            Tokenizer.from_dir(config.model_dir),
            ModelLimits.from_dir(config.model_dir),
            ChatTemplate.from_dir(config.model_dir, config.chat_template, config.tool_call_parser),
        )

    async def close(self) -> None:
        self.pool.close()
        await self.client.close()

    async def admit(self, api_key: str | None) -> ModelInfo:
        """The router's ``ModelInfo`` if it admits ``api_key``, else its refusal (401)."""
        return await self.callers.admit(api_key)

    # -- /v1/models, /health -------------------------------------------------------------------

    async def models(self, api_key: str | None) -> ModelList:
        """The served model, as the router reports it. The router checks ``api_key`` as it
        does for a generation, so a secured cluster lists nothing to a caller without one."""
        try:
            info = await self.client.model_info(timeout=self.config.timeout_s, api_key=api_key)
        except PdServeClientError as err:
            raise from_client_error(err, prompt_param="", api_key_sent=api_key is not None) from err
        card = ModelCard(
            id=self.config.model_name,
            created=self.created,
            root=str(self.config.model_dir),
            max_model_len=info.max_model_len,
        )
        return ModelList(data=[card])

    async def model(self, model_id: str, api_key: str | None) -> ModelCard:
        """``GET /v1/models/{model}``: the card of the served model, or a 404."""
        info = await self.admit(api_key)
        return utility.model_card(self.preparer, model_id, info, self.created)

    async def healthy(self) -> bool:
        """The router's gRPC health check says SERVING."""
        return await self.client.health()

    # -- generation ----------------------------------------------------------------------------

    async def completions(
        self, raw: bytes, watch: Watch, api_key: str | None = None
    ) -> Completion | AsyncIterator[str]:
        """``POST /v1/completions``; ``raw``: the body's bytes, after ``admit``."""
        return await completion_api.completions(self.served, raw, watch, api_key)

    async def chat(
        self, raw: bytes, watch: Watch, api_key: str | None = None
    ) -> ChatCompletion | AsyncIterator[str]:
        """``POST /v1/chat/completions``; ``raw``: the body's bytes, after ``admit``."""
        return await chats.chat(self.served, raw, watch, api_key)

    # -- /tokenize, /detokenize ----------------------------------------------------------------

    async def tokenize(self, raw: bytes, info: ModelInfo) -> TokenizeResponse:
        """``POST /tokenize``; ``info``: ``admit``'s answer."""
        return await self.pool.run(len(raw), lambda: utility.tokenize(self.preparer, raw, info))

    async def detokenize(self, raw: bytes) -> DetokenizeResponse:
        """``POST /detokenize``, after ``admit``."""
        return await self.pool.run(len(raw), lambda: utility.detokenize(self.preparer, raw))
