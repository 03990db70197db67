"""The Router service's answers: ``RouteChunk`` -> ``GenerateChunk`` / ``GenerateResponse``."""

from __future__ import annotations

from pdserve.convert.common import finish_reason_to_proto, timing_to_proto, usage_to_proto
from pdserve.convert.logprobs import prompt_to_proto, tops_to_proto
from pdserve.router.output import RouteChunk, RouteUsage
from pdserve.v1 import common_pb2, router_pb2


def usage_of(u: RouteUsage | None) -> common_pb2.Usage | None:
    """The wire form of a request's token accounting (None before the last chunk)."""
    if u is None:
        return None
    return usage_to_proto(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=u.cached_tokens,
    )


def generate_chunk(chunk: RouteChunk, *, first: bool) -> router_pb2.GenerateChunk:
    """One streamed ``Router.Generate`` chunk; the request id goes with the first only."""
    return router_pb2.GenerateChunk(
        token_ids=chunk.token_ids,
        text=chunk.text,
        logprobs=chunk.logprobs,
        finish_reason=finish_reason_to_proto(chunk.finish_reason),
        usage=usage_of(chunk.usage),
        timing=timing_to_proto(chunk.timing) if chunk.timing is not None else None,
        request_id=chunk.request_id if first else "",
        top_logprobs=tops_to_proto(chunk.top_logprobs),
        prompt_logprobs=(
            prompt_to_proto(chunk.prompt_logprobs) if chunk.prompt_logprobs is not None else None
        ),
    )


def generate_response(total: RouteChunk) -> router_pb2.GenerateResponse:
    """The ``Router.GenerateUnary`` answer: the whole response as one message."""
    return router_pb2.GenerateResponse(
        text=total.text,
        token_ids=total.token_ids,
        logprobs=total.logprobs,
        finish_reason=finish_reason_to_proto(total.finish_reason),
        usage=usage_of(total.usage),
        timing=timing_to_proto(total.timing) if total.timing is not None else None,
        request_id=total.request_id,
        top_logprobs=tops_to_proto(total.top_logprobs),
        prompt_logprobs=(
            prompt_to_proto(total.prompt_logprobs) if total.prompt_logprobs is not None else None
        ),
    )
