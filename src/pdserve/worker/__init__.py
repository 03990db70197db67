"""The worker roles: prefill, decode and mixed workers, their runtime, options and heartbeats.

The engine thread loop lives in ``pdserve.engine_loop``, prefix reuse in ``pdserve.prefix``,
the per-request timing record in ``pdserve.timing``.
"""

from __future__ import annotations

from pdserve.worker.decode import DecodeWorker
from pdserve.worker.delta import DecodeDelta, Finished
from pdserve.worker.handoff import KVLocation, TransferRecord, store_key
from pdserve.worker.heartbeat import WorkerHeartbeat, WorkerIdentity, worker_info
from pdserve.worker.placement import TransferOptions
from pdserve.worker.prefill import PrefillResult, PrefillWorker, check_request

__all__ = [
    "DecodeDelta",
    "DecodeWorker",
    "Finished",
    "KVLocation",
    "PrefillResult",
    "PrefillWorker",
    "TransferOptions",
    "TransferRecord",
    "WorkerHeartbeat",
    "WorkerIdentity",
    "check_request",
    "store_key",
    "worker_info",
]
