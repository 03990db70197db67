"""Builders for scheduling unit tests."""

from __future__ import annotations

from typing import Any

from pdserve.scheduling.capacity import Claim, WorkerView
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole


def worker(worker_id: str, role: WorkerRole = WorkerRole.DECODE, **overrides: Any) -> WorkerInfo:
    fields: dict[str, Any] = {
        "id": worker_id,
        "role": role,
        "address": f"10.0.0.1:{5000 + len(worker_id)}",
        "host": "node-a",
        "model_fingerprint": "llama-57m-bf16",
        "kv_blocks_total": 100,
        "kv_blocks_free": 100,
        "block_size": 16,
        "max_batch_tokens": 512,
    }
    fields.update(overrides)
    return WorkerInfo(**fields)


def view(
    worker_id: str,
    role: WorkerRole = WorkerRole.DECODE,
    *,
    reserved_tokens: int = 0,
    reserved_blocks: int = 0,
    **overrides: Any,
) -> WorkerView:
    return WorkerView(worker(worker_id, role, **overrides), Claim(reserved_tokens, reserved_blocks))
