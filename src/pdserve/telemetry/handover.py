"""Stage boundaries handed from service to service, so that a request's stages tile it.

A request crosses processes: router -> scheduler -> router -> prefill -> router -> decode.
Between one service's last stage and the next service's first lies time that is no service's
own work: the answer travelling back, the router sending the next call, that call
travelling, the next worker's event loop picking it up (on a busy worker, after its engine
thread lets go of the GIL). For the stage durations to add up to the end-to-end time, that
time is handed over explicitly and counted in the next service's first stage:

* backward: a service marks when its last stage of the call ended (``mark_stage_end``);
  ``StageEndInterceptor`` returns the mark in the call's trailing metadata
  (``x-pdserve-stage-end-ns``) and the caller reads it with ``stage_end_of(call)``;
* forward: the caller makes its next call inside ``handing_over(t, root)``, ``t`` being the
  end of the previous stage (or the moment of the call): ``t`` travels as the W3C baggage
  entry ``pdserve.stage_start_ns`` next to the trace context, and the callee's first stage
  starts there (``stage_start(own_start)``).

A stage that starts before its service's SERVER span cannot be that span's child (a child lies
inside its parent). So every stage span is a child of the request's root stage,
``router.request``, whose span context travels as baggage entry ``pdserve.stage_parent`` (W3C
``traceparent`` form); ``stage_parent()`` gives the context to record stages under (the
current one, when the caller sent none). The gRPC spans keep their own parentage.

Both need the tracing interceptors (the baggage rides on them); without tracing every helper
falls back to the local times. Times are Unix epoch ns: exact on one host, across hosts as good
as the clocks' synchronisation. A handed-over start later than the callee's own start (a
clock ahead) is ignored, so no stage runs backwards.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from grpc.aio import ServicerContext
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context

BAGGAGE_KEY = "pdserve.stage_start_ns"
PARENT_KEY = "pdserve.stage_parent"
TRAILER_KEY = "x-pdserve-stage-end-ns"

_HANDLER_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


@dataclass(slots=True)
class _Mark:
    end_ns: int | None = None


_MARK: contextvars.ContextVar[_Mark | None] = contextvars.ContextVar(
    "pdserve_stage_end", default=None
)


def _traceparent(ctx: trace.SpanContext) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


@contextmanager
def handing_over(start_ns: int, root: trace.Span | None = None) -> Iterator[None]:
    """Calls started in the ``with`` body tell their callee that its stage starts at
    ``start_ns`` and is a child of ``root`` (the interceptors copy the context when the call
    is created)."""
    ctx = baggage.set_baggage(BAGGAGE_KEY, str(start_ns))
    root_ctx = root.get_span_context() if root is not None else None
    if root_ctx is not None and root_ctx.is_valid:
        ctx = baggage.set_baggage(PARENT_KEY, _traceparent(root_ctx), ctx)
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def stage_parent(default: otel_context.Context | None = None) -> otel_context.Context | None:
    """The context to record this call's stages under: the root stage the caller handed
    over (if it belongs to the current trace), else ``default``."""
    raw = baggage.get_baggage(PARENT_KEY)
    parts = raw.split("-") if isinstance(raw, str) else []
    if len(parts) != 4:
        return default
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return default
    current = trace.get_current_span().get_span_context()
    if not trace_id or not span_id or (current.is_valid and current.trace_id != trace_id):
        return default
    root = trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(flags))
    return trace.set_span_in_context(trace.NonRecordingSpan(root))


@contextmanager
def within(ctx: otel_context.Context | None) -> Iterator[None]:
    """Make ``ctx`` current for the ``with`` body (nothing when None)."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def _parse(value: object) -> int | None:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str):
        return None
    try:
        parsed = int(value)
    except ValueError:
        return None
    return parsed if parsed > 0 else None


def stage_start(own_start_ns: int) -> int:
    """Where this call's first stage starts: the caller's handed-over time, else (or if
    that lies after it) ``own_start_ns``."""
    handed = _parse(baggage.get_baggage(BAGGAGE_KEY))
    return own_start_ns if handed is None else min(handed, own_start_ns)


def mark_stage_end(end_ns: int) -> None:
    """This call's last stage ended at ``end_ns``: tell the caller (no-op outside a call
    served through ``StageEndInterceptor``)."""
    mark = _MARK.get()
    if mark is not None:
        mark.end_ns = end_ns


async def stage_end_of(call: Any) -> int | None:
    """The stage end a finished call's callee marked, if it did (``call``: a grpc.aio call)."""
    metadata = await call.trailing_metadata()
    for key, value in metadata or ():
        if key == TRAILER_KEY:
            return _parse(value)
    return None


def _trailer(context: ServicerContext[Any, Any], mark: _Mark) -> None:
    if mark.end_ns is not None:
        context.set_trailing_metadata(((TRAILER_KEY, str(mark.end_ns)),))


def _wrap(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            mark = _Mark()
            _MARK.set(mark)  # the handler's own task context: visible to it, gone after it
            async for item in behavior(request, context):
                yield item
            _trailer(context, mark)

        return stream

    async def call(request: Any, context: ServicerContext[Any, Any]) -> Any:
        mark = _Mark()
        _MARK.set(mark)
        result = behavior(request, context)
        value = await result if isinstance(result, Awaitable) else result
        _trailer(context, mark)
        return value

    return call


class StageEndInterceptor(grpc.aio.ServerInterceptor):
    """Returns each call's ``mark_stage_end`` in its trailing metadata (successful calls)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        for kind in _HANDLER_KINDS:
            behavior = getattr(handler, kind, None)
            if behavior is not None:
                return handler._replace(**{kind: _wrap(behavior)})
        return handler
