"""The faults measured: each a cluster shape and the process SIGKILLed in it.

Every cluster is supervised as ``pdserve up`` runs it (restarts with backoff), on the tiny or
small demo model in float32 (so every answer can be checked token for token against the
engine run in this process). Where the issue is a spare, the cluster has one: two routers for
a router's death, two scheduler replicas, two prefill or decode or mixed workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pdserve.errors import InvalidArgumentError
from pdserve.launcher import Cluster
from pdserve.supervisor import REDIS, RestartPolicy

WORKER_ARGS = (
    "--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
    "--heartbeat-interval-s", "0.5", "--janitor-interval-s", "0.5", "--kv-lease-s", "5",
    "--kv-transfer-timeout-s", "4",
)  # fmt: skip
"""Fast failure detection (heartbeats every 0.5 s), hand-offs nobody takes expire soon."""
SCHEDULER_ARGS = ("--reservation-ttl-s", "5")
RESTARTS = RestartPolicy(initial_backoff_s=0.2, max_backoff_s=2.0, poll_s=0.05)


@dataclass(frozen=True, slots=True)
class Scenario:
    """One fault: the cluster it happens in, and the victim (a service name, or ``redis``)."""

    name: str
    victim: str
    cluster: Mapping[str, Any] = field(default_factory=dict)
    """``launcher.Cluster`` fields besides the common ones."""
    http: bool = False
    """Clients call the HTTP gateway instead of the routers."""

    def make(self, model: Path, *, log_dir: Path | None = None) -> Cluster:
        options: dict[str, Any] = {
            "mode": "disaggregated", "num_prefill": 1, "num_decode": 1,
            "worker_args": WORKER_ARGS, "scheduler_args": SCHEDULER_ARGS,
            "log_level": "WARNING", "supervise": True, "restart_policy": RESTARTS,
            "log_dir": log_dir, **self.cluster,
        }  # fmt: skip
        if self.http:
            options["http_port"] = 0
        return Cluster(model, **options)


_ALL = (
    Scenario("router", "router-1", {"num_routers": 2}),
    Scenario("scheduler", "scheduler"),
    Scenario("scheduler-replica", "scheduler-1", {"num_schedulers": 2}),
    Scenario("prefill", "prefill-0", {"num_prefill": 2}),
    Scenario("decode", "decode-0", {"num_decode": 2}),
    Scenario("mixed", "mixed-0", {"mode": "colocated", "num_decode": 2}),
    Scenario("kvstore", "kvstore"),
    Scenario("redis", REDIS),
    Scenario("gateway", "gateway", http=True),
)
SCENARIOS: Mapping[str, Scenario] = MappingProxyType({s.name: s for s in _ALL})


def pick(names: Sequence[str]) -> list[Scenario]:
    """The scenarios named (all of them for an empty list), in the order given."""
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        known = ", ".join(SCENARIOS)
        raise InvalidArgumentError("--kinds", f"unknown {', '.join(unknown)}; known: {known}")
    return [SCENARIOS[n] for n in names] if names else list(_ALL)
