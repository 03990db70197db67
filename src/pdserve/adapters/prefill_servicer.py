"""The Prefill gRPC service: translates pdserve.v1 Prefill messages to ``PrefillWorker`` calls.

Served by prefill workers and by mixed workers given a KV store (see ``pdserve.adapters``)."""

from __future__ import annotations

from typing import Any, TypeAlias

from grpc.aio import ServicerContext

from pdserve.adapters.worker import engine_request, prefill_response
from pdserve.handoff import HandoffRoute
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from pdserve.worker.prefill import PrefillWorker
from pdserve.worker.stages import StageRecorder

Context: TypeAlias = ServicerContext[Any, Any]


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """pdserve.v1.Prefill on top of one PrefillWorker."""

    def __init__(self, worker: PrefillWorker, stages: StageRecorder | None = None) -> None:
        self.worker = worker
        self.stages = stages or StageRecorder()

    async def Prefill(  # noqa: N802 - gRPC method names
        self, request: prefill_pb2.PrefillRequest, context: Context
    ) -> prefill_pb2.PrefillResponse:
        call = self.stages.prefill(request.request_id, len(request.prompt_token_ids))
        route = HandoffRoute(request.decode_address, request.decode_host, request.transport)
        result = await self.worker.prefill(engine_request(request, context.time_remaining()), route)
        call.returned(result)
        return prefill_response(result)
