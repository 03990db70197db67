"""Client SDK of a pdserve cluster: ``Client`` and ``AsyncClient`` talk to the Router service.

Imports grpc and the generated messages only (no torch), so it is cheap to use anywhere.
"""

from __future__ import annotations

from pdserve.client.client import AsyncClient, Client
from pdserve.client.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    Overloaded,
    PdServeClientError,
    PermissionDenied,
    RequestTooLarge,
    ServerError,
    Unauthenticated,
    Unavailable,
)
from pdserve.client.request import DEFAULT_TIMEOUT_S, RequestOptions, RetryPolicy
from pdserve.client.results import Completion, Delta, ModelInfo, Timing, Usage
from pdserve.client.stream import AsyncCompletionStream, CompletionStream
from pdserve.security.tls import TlsConfig

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncClient",
    "AsyncCompletionStream",
    "Cancelled",
    "Client",
    "Completion",
    "CompletionStream",
    "DeadlineExceeded",
    "Delta",
    "InvalidRequest",
    "ModelInfo",
    "NotFound",
    "Overloaded",
    "PdServeClientError",
    "PermissionDenied",
    "RequestOptions",
    "RequestTooLarge",
    "RetryPolicy",
    "ServerError",
    "Timing",
    "TlsConfig",
    "Unauthenticated",
    "Unavailable",
    "Usage",
]
