"""The router's request flow: validate, place, prefill, hand over, decode, stream.

``RequestFlow`` is the library behind the Router gRPC service (``services/router``), which
only translates messages. See ``flow.py`` for the order of calls and the clean-up guarantees.
"""

from __future__ import annotations

from pdserve.router.channels import ChannelPool
from pdserve.router.flow import FlowConfig, RequestFlow
from pdserve.router.limits import RequestLimits
from pdserve.router.output import RouteChunk, RouteUsage
from pdserve.router.request import ModelLimits, RequestPreparer, RouteRequest, prepare_request

__all__ = [
    "ChannelPool",
    "FlowConfig",
    "ModelLimits",
    "RequestFlow",
    "RequestLimits",
    "RequestPreparer",
    "RouteChunk",
    "RouteRequest",
    "RouteUsage",
    "prepare_request",
]
