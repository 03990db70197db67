"""The worker roles: prefill, decode and mixed workers, their runtime, options and heartbeats.

The engine thread loop lives in ``pdserve.engine_loop``, prefix reuse in ``pdserve.prefix``,
the per-request timing record in ``pdserve.timing``, the KV hand-off (its interface,
``KVLocation``, ``HandoffRecord`` and transports) in ``pdserve.transfer``, each side's owner
of it (``PrefillConnector``, ``DecodeConnector``) in ``pdserve.handoff``.
"""

from __future__ import annotations

from pdserve.worker.decode import DecodeWorker
from pdserve.worker.delta import DecodeDelta, Finished
from pdserve.worker.heartbeat import WorkerHeartbeat, WorkerIdentity, worker_info
from pdserve.worker.prefill import PrefillResult, PrefillWorker, check_request

__all__ = [
    "DecodeDelta",
    "DecodeWorker",
    "Finished",
    "PrefillResult",
    "PrefillWorker",
    "WorkerHeartbeat",
    "WorkerIdentity",
    "check_request",
    "worker_info",
]
