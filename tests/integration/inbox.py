"""What a decode worker's inbox still holds (``Decode.InboxStat``): the leak checks' view of
``direct`` hand-offs, as ``KVStore.Stat`` is the KV store's."""

from __future__ import annotations

import grpc

from pdserve.v1 import decode_pb2, decode_pb2_grpc


async def inbox_held(address: str) -> tuple[int, int]:
    """(hand-offs held, pushes still arriving) in the decode worker at ``address``."""
    async with grpc.aio.insecure_channel(address) as channel:
        r = await decode_pb2_grpc.DecodeStub(channel).InboxStat(
            decode_pb2.InboxStatRequest(), timeout=5
        )
    return r.num_entries, r.num_writing
