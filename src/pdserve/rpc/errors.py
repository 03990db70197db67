"""Map exceptions raised by servicer methods to gRPC status codes, in one place.

``ErrorInterceptor`` wraps every method handler of a ``grpc.aio`` server (unary and streaming
responses alike):

* a ``PdServeError`` becomes ``StatusCode[err.grpc_code]`` with ``str(err)`` as details;
* a failed downstream call (``grpc.aio.AioRpcError``) passes its status code on, so a caller
  sees UNAVAILABLE from a dead worker, not INTERNAL;
* anything else is logged with its traceback and becomes INTERNAL, never swallowed;
* an abort the servicer issued itself, and cancellation, pass through untouched.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from grpc.aio import AbortError, AioRpcError, ServicerContext

from pdserve.errors import PdServeError

logger = logging.getLogger(__name__)

_HANDLER_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details that ``err`` maps to."""
    if isinstance(err, PdServeError):
        return grpc.StatusCode[err.grpc_code], str(err)
    if isinstance(err, AioRpcError):
        return err.code(), f"downstream call failed: {err.details()}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}"


async def _abort(context: ServicerContext[Any, Any], method: str, err: Exception) -> NoReturn:
    code, details = status_of(err)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("unhandled error in %s", method, exc_info=err)
    else:
        logger.info("%s -> %s: %s", method, code.name, details)
    await context.abort(code, details)
    raise AssertionError("context.abort returned")  # abort always raises; keeps mypy honest


def _wrap(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """A handler with the same calling convention as ``behavior`` that maps its errors."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            try:
                async for item in behavior(request, context):
                    yield item
            except AbortError:
                raise
            except Exception as err:
                await _abort(context, method, err)

        return stream

    async def call(request: Any, context: ServicerContext[Any, Any]) -> Any:
        # Coroutine handlers, including streaming ones that use context.write() and return None.
        try:
            result = behavior(request, context)
            return await result if isinstance(result, Awaitable) else result
        except AbortError:
            raise
        except Exception as err:
            await _abort(context, method, err)

    return call


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Applies the error mapping of this module to every method of the server."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # unknown method: gRPC answers UNIMPLEMENTED
        method: str = handler_call_details.method
        for kind in _HANDLER_KINDS:
            behavior = getattr(handler, kind, None)
            if behavior is not None:
                # The handler is a namedtuple in grpc's implementation.
                return handler._replace(**{kind: _wrap(behavior, method)})
        return handler
