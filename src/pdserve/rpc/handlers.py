"""Registering a generated service with some of its methods' handlers replaced.

A method whose messages skip protobuf's copies (``Decode.Push``, through the KV chunk codec of
``pdserve.kvstore.wire``) needs its own serializers; every other method of the service keeps
the generated ones, including methods added to the proto later.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from pdserve.errors import InvalidArgumentError
from pdserve.rpc.server import AddServicerFn


class _Capture:
    """Stands in for a server to take the handlers a generated ``add_*`` function registers."""

    def __init__(self) -> None:
        self.name = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        pass  # the same handlers come through add_registered_method_handlers

    def add_registered_method_handlers(
        self, name: str, handlers: Mapping[str, grpc.RpcMethodHandler]
    ) -> None:
        self.name, self.handlers = name, dict(handlers)


def add_with_overrides(
    add: AddServicerFn,
    servicer: object,
    server: grpc.aio.Server,
    overrides: Mapping[str, grpc.RpcMethodHandler],
) -> None:
    """What ``add(servicer, server)`` does (a generated ``add_XServicer_to_server``), with the
    handlers of the methods named in ``overrides`` replaced."""
    capture = _Capture()
    add(servicer, capture)
    unknown = set(overrides) - set(capture.handlers)
    if unknown:
        raise InvalidArgumentError("overrides", f"{sorted(unknown)} not in {capture.name}")
    handlers = {**capture.handlers, **overrides}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.name, handlers),))
    server.add_registered_method_handlers(capture.name, handlers)
