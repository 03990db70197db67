"""``HeartbeatAgents``: where a decode worker finds the NIXL agents prefill workers publish.

A prefill worker with the nixl transport publishes its agent's descriptor and fingerprint in
its heartbeat (``WorkerInfo.kv_agent``, ``kv_agent_fingerprint``). A nixl handle names the
agent; this finds the heartbeat that publishes it (the worker id is remembered, so later
look-ups read one key; a miss lists the live workers again).
"""

from __future__ import annotations

from pdserve.errors import KVTransferError
from pdserve.scheduling.registry import RedisWorkerRegistry
from pdserve.scheduling.worker_info import WorkerInfo
from pdserve.transfer.nixl.agent import AgentDescriptor


def _published_agent(info: WorkerInfo) -> str:
    if not info.kv_agent:
        return ""
    try:
        return AgentDescriptor.decode(info.kv_agent).agent
    except KVTransferError:
        return ""


class HeartbeatAgents:
    """An ``AgentDirectory`` (``transfer.nixl.reader``) over the workers' heartbeats."""

    def __init__(self, registry: RedisWorkerRegistry) -> None:
        self.registry = registry
        self._workers: dict[str, str] = {}  # agent name -> worker id

    async def lookup(self, agent: str) -> tuple[str, str] | None:
        worker_id = self._workers.get(agent)
        if worker_id is not None:
            info = await self.registry.get(worker_id)
            if info is not None and _published_agent(info) == agent:
                return info.kv_agent, info.kv_agent_fingerprint
            del self._workers[agent]
        for info in await self.registry.list_workers():
            if _published_agent(info) == agent:
                self._workers[agent] = info.id
                return info.kv_agent, info.kv_agent_fingerprint
        return None

    async def close(self) -> None:
        await self.registry.redis.aclose()
