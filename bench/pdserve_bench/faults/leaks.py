"""What a cluster still holds once its load is done: the census behind "no leak".

Each figure is read the way an operator would read it: the workers' heartbeats (what
``pdserve status`` shows: free KV blocks, running sequences), the KV store's ``Stat``, each
decode worker's ``InboxStat``, the shm segments of the cluster's processes, and the live
reservations in Redis. A quiet cluster holds nothing: ``Holdings.clean``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import cast

import grpc

from pdserve.kvstore.client import KVStoreClient
from pdserve.launcher import Cluster, read_heartbeats
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.registry import connect
from pdserve.transfer.janitor import SHM_DIR, holds_hand_off, parse_owner_pid
from pdserve.v1 import decode_pb2, decode_pb2_grpc


@dataclass(frozen=True, slots=True)
class Holdings:
    """What the cluster holds (every field 0 on a quiet cluster)."""

    workers_missing: int
    """Workers without a live heartbeat (a dead one not registered again yet)."""
    busy_blocks: int
    """KV blocks not free, over every worker."""
    running: int
    """Sequences the workers say they run."""
    store_entries: int
    """Hand-off entries (not prefix-cache ones) or writes in progress in the KV store."""
    inbox_entries: int
    """Hand-offs held or pushes arriving in decode workers' inboxes."""
    shm_segments: int
    """Segments of dead cluster processes, or live ones still holding a hand-off."""
    reservations: int
    """Live reservation records and members in Redis."""

    @property
    def clean(self) -> bool:
        return not any(asdict(self).values())

    def to_json(self) -> dict[str, int]:
        return asdict(self)


async def inbox_held(address: str) -> tuple[int, int]:
    """(hand-offs held, pushes still arriving) in the decode worker at ``address``."""
    async with grpc.aio.insecure_channel(address) as channel:
        r = await decode_pb2_grpc.DecodeStub(channel).InboxStat(
            decode_pb2.InboxStatRequest(), timeout=5
        )
    return r.num_entries, r.num_writing


async def live_reservations(redis_url: str, keys: KeySpace) -> int:
    """Reservation records and live members of any worker's reservation set."""
    redis = connect(redis_url)
    try:
        records = await redis.keys(keys.reservation("*"))
        seconds, micros = await redis.time()
        now_ms = seconds * 1000 + micros / 1000
        members = 0
        for key in await redis.keys(keys.reservations_on("*")):
            reply = await redis.zrange(key, 0, -1, withscores=True)
            members += sum(s > now_ms for _, s in cast(list[tuple[bytes, float]], reply))
    finally:
        await redis.aclose()
    return len(records) + members


def cluster_pids(c: Cluster, dead: set[int]) -> set[int]:
    return {s.proc.pid for s in c.services if s.proc is not None} | dead


async def holdings(c: Cluster, *, dead_pids: set[int]) -> Holdings:
    """The census now (module docstring). ``dead_pids``: the cluster's processes killed on
    purpose; their shm segments must all be gone, a live process's may stay between
    hand-offs (its reused slots) unless one still holds a hand-off."""
    assert c.redis_url is not None
    beats = read_heartbeats(c.redis_url, c.namespace)
    async with KVStoreClient(c.kvstore_address, timeout_s=5) as client:
        t = (await client.stat()).totals
    assert t is not None
    inbox = 0
    for s in c.workers("decode"):
        inbox += sum(await inbox_held(s.address))
    pids = cluster_pids(c, dead_pids)
    segments = 0
    for path in SHM_DIR.glob("pdserve-kv-*"):
        owner = parse_owner_pid(path.name)
        if owner in dead_pids or (owner in pids and holds_hand_off(path)):
            segments += 1
    return Holdings(
        workers_missing=max(0, len(c.workers()) - len(beats)),
        busy_blocks=sum(w.kv_blocks_total - w.kv_blocks_free for w in beats),
        running=sum(w.running_seqs for w in beats),
        store_entries=t.num_entries - t.num_cache_entries + t.num_writing,
        inbox_entries=inbox,
        shm_segments=segments,
        reservations=await live_reservations(c.redis_url, KeySpace(c.namespace)),
    )
