"""The Decode and Mixed gRPC services: translate pdserve.v1 messages to ``DecodeWorker`` calls
(``Decode``, ``Mixed.Generate``) and to its hand-off connector's (``Push``, ``Drop``,
``InboxStat``, ``Prefetch``, ``CachedPrefix``: ``pdserve.handoff.decode``).

``Decode.Push`` takes its chunks through the KV chunk codec (``pdserve.kvstore.wire``), so
register ``DecodeServicer`` with ``add_decode_servicer``, not the generated function.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, TypeAlias

import grpc
from grpc.aio import ServicerContext

from pdserve.adapters.worker import chunk_to_proto, engine_request
from pdserve.convert.kv import handle_from_proto
from pdserve.errors import InvalidArgumentError, WorkerUnavailableError
from pdserve.kvstore.wire import Chunk, chunk_stream_handler
from pdserve.prefix.convert import cached_prefix_response, prefix_query_from_proto
from pdserve.rpc.handlers import add_with_overrides
from pdserve.transfer.stream.inbox import Inbox
from pdserve.v1 import decode_pb2, decode_pb2_grpc, kvstore_pb2
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
            engine_request(request, context.time_remaining()),
            (request.first_token_id, request.first_logprob),
            handle_from_proto(request.kv),
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
        outcome = await self.worker.connector.prefetch(handle_from_proto(request.kv))
        return decode_pb2.PrefetchResponse(
            accepted=outcome.accepted, ready=outcome.ready, reason=outcome.reason
        )

    async def CachedPrefix(  # noqa: N802 - gRPC method names
        self, request: decode_pb2.CachedPrefixRequest, context: Context
    ) -> decode_pb2.CachedPrefixResponse:
        found = await self.worker.connector.cached_prefix(prefix_query_from_proto(request))
        return cached_prefix_response(found)

    async def Push(  # noqa: N802 - gRPC method names
        self, request_iterator: AsyncIterator[Chunk], context: Context
    ) -> kvstore_pb2.PutResponse:
        received = await self._inbox().receive(request_iterator)
        return kvstore_pb2.PutResponse(
            key=received.key,
            num_bytes=received.num_bytes,
            num_chunks=received.num_chunks,
            lease_s=received.lease_s,
        )

    async def Drop(  # noqa: N802 - gRPC method names
        self, request: kvstore_pb2.DeleteRequest, context: Context
    ) -> kvstore_pb2.DeleteResponse:
        if not request.key:
            raise InvalidArgumentError("key", "must not be empty")
        return kvstore_pb2.DeleteResponse(deleted=self._inbox().drop(request.key))

    async def InboxStat(  # noqa: N802 - gRPC method names
        self, request: decode_pb2.InboxStatRequest, context: Context
    ) -> decode_pb2.InboxStatResponse:
        stats = self._inbox().stats()
        return decode_pb2.InboxStatResponse(
            used_bytes=stats.used_bytes,
            capacity_bytes=stats.capacity_bytes,
            num_entries=stats.num_entries,
            num_writing=stats.num_writing,
        )

    def _inbox(self) -> Inbox:
        inbox = self.worker.connector.inbox
        if inbox is None:
            raise WorkerUnavailableError("this worker takes no pushed hand-offs")
        return inbox


def add_decode_servicer(servicer: DecodeServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as ``pdserve.v1.Decode``: every method as generated, but ``Push``
    through the KV chunk codec (its chunks' data stays where gRPC received it)."""
    add_with_overrides(
        decode_pb2_grpc.add_DecodeServicer_to_server,
        servicer,
        server,
        {"Push": chunk_stream_handler(servicer.Push)},
    )


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
        stream = self.worker.generate(engine_request(request, context.time_remaining()))
        try:
            async with aclosing(stream):
                async for delta in stream:
                    call.sent(delta)
                    yield chunk_to_proto(delta)
        finally:
            call.ended()
