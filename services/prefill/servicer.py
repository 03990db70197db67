"""The Prefill gRPC service: translates pdserve.v1 Prefill messages to ``PrefillWorker`` calls."""

from __future__ import annotations

from typing import Any, TypeAlias

from grpc.aio import ServicerContext

from pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from pdserve.worker.prefill import PrefillWorker
from pdserve.worker.protocol import (
    finish_reason_to_proto,
    handle_to_proto,
    sampling_from_proto,
    transfer_to_proto,
)

Context: TypeAlias = ServicerContext[Any, Any]


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """pdserve.v1.Prefill on top of one PrefillWorker."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(  # noqa: N802 - gRPC method names
        self, request: prefill_pb2.PrefillRequest, context: Context
    ) -> prefill_pb2.PrefillResponse:
        result = await self.worker.prefill(
            request.request_id,
            list(request.prompt_token_ids),
            sampling_from_proto(request.sampling),
            tenant=request.tenant,
            reservation_id=request.reservation_id,
            decode_address=request.decode_address,
            decode_host=request.decode_host,
            transport=request.transport,
        )
        response = prefill_pb2.PrefillResponse(
            first_token_id=result.first_token_id,
            first_logprob=result.first_logprob,
            finish_reason=finish_reason_to_proto(result.finish_reason),
            queue_ms=result.queue_ms,
            compute_ms=result.compute_ms,
            transfer_ms=result.transfer_ms,
            transfer_bytes=result.transfer_bytes,
            num_cached_tokens=result.num_cached_tokens,
        )
        if result.kv is not None:
            response.kv.CopyFrom(handle_to_proto(result.kv))
        if result.transfer is not None:
            response.transfer.CopyFrom(transfer_to_proto(result.transfer))
        return response
