"""The Decode and Mixed gRPC services: translate pdserve.v1 messages to ``DecodeWorker`` calls."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, TypeAlias

from grpc.aio import ServicerContext

from pdserve.errors import InvalidArgumentError
from pdserve.rpc.convert import sampling_from_proto
from pdserve.rpc.convert.kv import handle_from_proto
from pdserve.rpc.convert.prefix import cached_prefix_response, prefix_query_from_proto
from pdserve.rpc.convert.worker import chunk_to_proto
from pdserve.v1 import decode_pb2, decode_pb2_grpc
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.stages import StageRecorder

Context: TypeAlias = ServicerContext[Any, Any]


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """pdserve.v1.Decode on top of one DecodeWorker; ``stages`` traces its calls."""

    def __init__(self, worker: DecodeWorker, stages: StageRecorder | None = None) -> None:
        self.worker = worker
        self.stages = stages or StageRecorder()

    async def Decode(  # noqa: N802 - gRPC method names
        self, request: decode_pb2.DecodeRequest, context: Context
    ) -> AsyncGenerator[decode_pb2.DecodeChunk, None]:
        if not request.HasField("kv"):
            raise InvalidArgumentError("kv", "a KV handle is required")
        call = self.stages.decode(request.request_id)
        stream = self.worker.decode(
            request.request_id,
            list(request.prompt_token_ids),
            (request.first_token_id, request.first_logprob),
            sampling_from_proto(request.sampling),
            handle_from_proto(request.kv),
            tenant=request.tenant,
            reservation_id=request.reservation_id,
            resumed=list(request.resumed_token_ids),
        )
        try:
            async with aclosing(stream):  # a cancelled RPC aborts the request at once
                async for delta in stream:
                    call.sent(delta)
                    yield chunk_to_proto(delta)
        finally:
            call.ended()

    async def Prefetch(  # noqa: N802 - gRPC method names
        self, request: decode_pb2.PrefetchRequest, context: Context
    ) -> decode_pb2.PrefetchResponse:
        if not request.HasField("kv"):
            raise InvalidArgumentError("kv", "a KV handle is required")
        outcome = await self.worker.prefetch(handle_from_proto(request.kv))
        return decode_pb2.PrefetchResponse(
            accepted=outcome.accepted, ready=outcome.ready, reason=outcome.reason
        )

    async def CachedPrefix(  # noqa: N802 - gRPC method names
        self, request: decode_pb2.CachedPrefixRequest, context: Context
    ) -> decode_pb2.CachedPrefixResponse:
        found = await self.worker.cached_prefix(prefix_query_from_proto(request))
        return cached_prefix_response(found)


class MixedServicer(decode_pb2_grpc.MixedServicer):
    """pdserve.v1.Mixed (colocated prefill + decode) on top of one DecodeWorker; ``stages``
    traces its calls."""

    def __init__(self, worker: DecodeWorker, stages: StageRecorder | None = None) -> None:
        self.worker = worker
        self.stages = stages or StageRecorder()

    async def Generate(  # noqa: N802 - gRPC method names
        self, request: decode_pb2.ColocatedRequest, context: Context
    ) -> AsyncGenerator[decode_pb2.DecodeChunk, None]:
        call = self.stages.generate(request.request_id, len(request.prompt_token_ids))
        stream = self.worker.generate(
            request.request_id,
            list(request.prompt_token_ids),
            sampling_from_proto(request.sampling),
            tenant=request.tenant,
            reservation_id=request.reservation_id,
        )
        try:
            async with aclosing(stream):
                async for delta in stream:
                    call.sent(delta)
                    yield chunk_to_proto(delta)
        finally:
            call.ended()
