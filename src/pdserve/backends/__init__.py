"""Engine backends: what computes behind a worker (see ``backends.base``).

Only the protocol and its types are imported here; the implementations are imported where a
worker is built (``backends.pytorch``, ``backends.tensorrt_llm``), so that nothing loads
``tensorrt_llm`` unless it is asked for.
"""

from __future__ import annotations

from pdserve.backends.base import (
    BACKEND_NAMES,
    SIM,
    TENSORRT_LLM,
    TORCH,
    BackendFeatures,
    Capacity,
    EngineBackend,
    Handoff,
    NativeKV,
    Prefilled,
    recompute_kv,
    refuse,
)

__all__ = [
    "BACKEND_NAMES",
    "SIM",
    "TENSORRT_LLM",
    "TORCH",
    "BackendFeatures",
    "Capacity",
    "EngineBackend",
    "Handoff",
    "NativeKV",
    "Prefilled",
    "recompute_kv",
    "refuse",
]
