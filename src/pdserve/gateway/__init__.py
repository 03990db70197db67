"""The OpenAI-compatible HTTP front door of a cluster (``services/gateway``).

A thin layer on the client SDK: each HTTP request becomes one router request per choice,
made with ``pdserve.client.AsyncClient``; routing, validation against the model and
cancellation stay with the router. Imports no torch.
"""

from __future__ import annotations

from pdserve.gateway.app import create_app
from pdserve.gateway.chat import FALLBACK_TEMPLATE, ChatTemplate
from pdserve.gateway.endpoints import Gateway, GatewayConfig
from pdserve.gateway.errors import GatewayError

__all__ = [
    "FALLBACK_TEMPLATE",
    "ChatTemplate",
    "Gateway",
    "GatewayConfig",
    "GatewayError",
    "create_app",
]
