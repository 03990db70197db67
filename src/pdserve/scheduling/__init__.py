"""Cluster-level scheduling: worker heartbeats, placement policies and reservations in Redis.

Pure Python on redis.asyncio: this package imports neither torch nor grpc.
"""

from __future__ import annotations

from pdserve.scheduling.capacity import CapacityLimits, Claim, Demand, Phase, WorkerView
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.policies import (
    POLICIES,
    LeastLoaded,
    PlacementPolicy,
    RoundRobin,
    make_policy,
)
from pdserve.scheduling.refresher import kept_fresh
from pdserve.scheduling.registry import Heartbeater, RedisWorkerRegistry, connect, redacted
from pdserve.scheduling.scheduler import Assignment, ClusterScheduler, Mode
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole

__all__ = [
    "POLICIES",
    "Assignment",
    "CapacityLimits",
    "Claim",
    "ClusterScheduler",
    "Demand",
    "Heartbeater",
    "KeySpace",
    "LeastLoaded",
    "Mode",
    "Phase",
    "PlacementPolicy",
    "RedisWorkerRegistry",
    "RoundRobin",
    "WorkerInfo",
    "WorkerRole",
    "WorkerView",
    "connect",
    "kept_fresh",
    "make_policy",
    "redacted",
]
