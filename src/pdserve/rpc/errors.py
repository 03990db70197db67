"""Map exceptions raised by servicer methods to gRPC status codes, in one place.

``ErrorInterceptor`` wraps every method handler of a ``grpc.aio`` server (unary and streaming
responses alike):

* a ``PdServeError`` becomes ``StatusCode[err.grpc_code]`` with ``str(err)`` as details;
* a failed downstream call (``grpc.aio.AioRpcError``) passes its status code on, so a caller
  sees UNAVAILABLE from a dead worker, not INTERNAL;
* anything else is logged with its traceback and becomes INTERNAL, never swallowed;
* an abort the servicer issued itself, and cancellation, pass through untouched;
* a request message that does not parse (garbage bytes, invalid UTF-8 in a string field) is
  INVALID_ARGUMENT. grpc parses a request before the handler runs and answers UNKNOWN when
  that fails, so the interceptor swaps each request deserializer for one that returns a
  ``MalformedRequest`` instead of raising, and the wrapped handler refuses that (for a
  request stream, at the message that did not parse).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from grpc.aio import AbortError, AioRpcError, ServicerContext

from pdserve.errors import InvalidArgumentError, PdServeError

logger = logging.getLogger(__name__)

_HANDLER_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
_REQUEST_STREAMS = ("stream_unary", "stream_stream")


@dataclass(frozen=True, slots=True)
class MalformedRequest:
    """What a request deserializer wrapped by ``ErrorInterceptor`` returns for bytes it
    cannot parse; the handler never sees it (it is refused with INVALID_ARGUMENT)."""

    reason: str

    def error(self) -> InvalidArgumentError:
        return InvalidArgumentError("request", f"malformed message: {self.reason}")


def tolerant_deserializer(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``parse``, returning a ``MalformedRequest`` where it would raise."""

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as err:  # any failure to parse client bytes is the client's
            return MalformedRequest(f"{type(err).__name__}: {err}")

    return deserialize


def _checked(request: Any) -> Any:
    if isinstance(request, MalformedRequest):
        raise request.error()
    return request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request)


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


def _wrap(behavior: Callable[..., Any], method: str, kind: str) -> Callable[..., Any]:
    """A handler with the same calling convention as ``behavior`` that maps its errors and
    refuses a ``MalformedRequest``."""
    check = _checked_stream if kind in _REQUEST_STREAMS else _checked

    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            try:
                async for item in behavior(check(request), context):
                    yield item
            except AbortError:
                raise
            except Exception as err:
                await _abort(context, method, err)

        return stream

    async def call(request: Any, context: ServicerContext[Any, Any]) -> Any:
        # Coroutine handlers, including streaming ones that use context.write() and return None.
        try:
            result = behavior(check(request), context)
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
                parse = handler.request_deserializer
                return handler._replace(
                    **{kind: _wrap(behavior, method, kind)},
                    request_deserializer=None if parse is None else tolerant_deserializer(parse),
                )
        return handler
