"""The KVStore service with transfer metrics: bytes and seconds of every Put and Get.

From the store's side a Put is a receive and a Get a send (``pdserve_kv_transfer_*`` with
``direction`` recv / send). A Put's seconds run from its first chunk's arrival to the stored
entry, so a layer-wise hand-off that streams in while the prefill computes counts its whole
length; a Get's from the call to its last chunk sent. Failed calls count nothing.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from pdserve.kvstore.wire import Chunk
from pdserve.transfer.base import TransportKind
from pdserve.v1 import kvstore_pb2
from pdserve.worker.observability import RECV, SEND
from pdserve.worker.worker_telemetry import WorkerTelemetry
from services.kvstore.servicer import Context, KVStoreServicer


class ObservedKVStoreServicer(KVStoreServicer):
    """``KVStoreServicer`` (same arguments) observing its transfers into ``telemetry``."""

    def __init__(
        self,
        *args: Any,
        telemetry: WorkerTelemetry,
        transport: str = TransportKind.STORE.value,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.telemetry = telemetry
        self.transport = transport

    async def Put(  # noqa: N802 - gRPC method names
        self, request_iterator: AsyncIterator[Chunk], context: Context
    ) -> kvstore_pb2.PutResponse:
        started = time.perf_counter()
        response = await super().Put(request_iterator, context)
        self.telemetry.metrics.observe_transfer(
            self.transport, RECV, response.num_bytes, time.perf_counter() - started
        )
        return response

    async def Get(  # noqa: N802 - gRPC method names
        self, request: kvstore_pb2.GetRequest, context: Context
    ) -> AsyncIterator[Chunk]:
        started = time.perf_counter()
        sent = 0
        async for chunk in super().Get(request, context):
            sent += len(chunk.header) + len(chunk.data)
            yield chunk
        self.telemetry.metrics.observe_transfer(
            self.transport, SEND, sent, time.perf_counter() - started
        )
