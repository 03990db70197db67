"""What every endpoint of one gateway works with (``Served``), and the ids of its answers."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pdserve.client import AsyncClient
from pdserve.gateway.callers import Callers
from pdserve.gateway.calls import Params, RouterCalls
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.pool import WorkPool
from pdserve.gateway.prepare import Preparer
from pdserve.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Served:
    """One gateway's router client, tokenizer, request preparation and worker threads."""

    config: GatewayConfig
    client: AsyncClient
    tokenizer: Tokenizer
    preparer: Preparer
    pool: WorkPool
    callers: Callers
    """The router's verdicts on keys, and its latest ``ModelInfo``."""
    created: int
    """When the gateway started (``created`` of the model card)."""

    def calls(self, api_key: str | None, params: Params) -> RouterCalls:
        return RouterCalls(self.client, self.config.timeout_s, api_key, params)


def response_id(prefix: str, request_id: str | None) -> str:
    """``{prefix}-{request_id}`` (vLLM's ``request_id`` extension), else a fresh one."""
    return f"{prefix}-{request_id or uuid.uuid4().hex}"
