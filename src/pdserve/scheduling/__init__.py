"""Cluster-level scheduling: worker heartbeats, placement policies and reservations in Redis.

Pure Python on redis.asyncio: this package imports neither torch nor grpc.
"""

from __future__ import annotations

from pdserve.scheduling.capacity import CapacityLimits, Claim, Demand, Phase, WorkerView
from pdserve.scheduling.costmodel import CostModel
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.placement import ModeDecision, Placer, Reason
from pdserve.scheduling.policies import (
    POLICIES,
    KvAware,
    LeastLoaded,
    PlacementPolicy,
    RoundRobin,
    make_policy,
)
from pdserve.scheduling.prefix_index import PrefixIndex, PromptBlocks
from pdserve.scheduling.redis_url import redacted
from pdserve.scheduling.refresher import kept_fresh
from pdserve.scheduling.registry import Heartbeater, RedisWorkerRegistry, connect
from pdserve.scheduling.scheduler import Assignment, ClusterScheduler, Mode, SloRefusalError
from pdserve.scheduling.worker_info import WorkerInfo, WorkerRole

__all__ = [
    "POLICIES",
    "Assignment",
    "CapacityLimits",
    "Claim",
    "ClusterScheduler",
    "CostModel",
    "Demand",
    "Heartbeater",
    "KeySpace",
    "KvAware",
    "LeastLoaded",
    "Mode",
    "ModeDecision",
    "Phase",
    "PlacementPolicy",
    "Placer",
    "PrefixIndex",
    "PromptBlocks",
    "Reason",
    "RedisWorkerRegistry",
    "RoundRobin",
    "SloRefusalError",
    "WorkerInfo",
    "WorkerRole",
    "WorkerView",
    "connect",
    "kept_fresh",
    "make_policy",
    "redacted",
]
