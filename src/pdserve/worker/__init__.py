"""The worker side: the engine on its own thread, prefill/decode logic, heartbeats, lifecycle."""

from __future__ import annotations

from pdserve.worker.async_engine import AsyncEngine
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.delta import DecodeDelta, StreamTiming
from pdserve.worker.engine_state import EngineSnapshot
from pdserve.worker.handoff import KVLocation, TransferRecord, store_key
from pdserve.worker.heartbeat import WorkerHeartbeat, WorkerIdentity, kv_fingerprint, worker_info
from pdserve.worker.placement import TransferOptions
from pdserve.worker.prefill import PrefillResult, PrefillWorker, check_request
from pdserve.worker.timing import RequestTiming

__all__ = [
    "AsyncEngine",
    "DecodeDelta",
    "DecodeWorker",
    "EngineSnapshot",
    "KVLocation",
    "PrefillResult",
    "PrefillWorker",
    "RequestTiming",
    "StreamTiming",
    "TransferOptions",
    "TransferRecord",
    "WorkerHeartbeat",
    "WorkerIdentity",
    "check_request",
    "kv_fingerprint",
    "store_key",
    "worker_info",
]
