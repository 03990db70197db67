"""The decode worker's cached-prefix query: ``PrefixQuery`` <-> ``CachedPrefixRequest``, and
its answer (``CachedPrefixResponse``)."""

from __future__ import annotations

from pdserve.engine.block_manager import BLOCK_HASH_BYTES
from pdserve.errors import InvalidArgumentError
from pdserve.prefix.decode import PrefixQuery
from pdserve.v1 import decode_pb2


def prefix_query_to_proto(query: PrefixQuery) -> decode_pb2.CachedPrefixRequest:
    return decode_pb2.CachedPrefixRequest(
        kv_fingerprint=query.kv_fingerprint,
        block_size=query.block_size,
        block_hashes=list(query.block_hashes),
    )


def prefix_query_from_proto(msg: decode_pb2.CachedPrefixRequest) -> PrefixQuery:
    """The query; ``InvalidArgumentError`` naming the field that is missing or malformed."""
    if not msg.kv_fingerprint:
        raise InvalidArgumentError("kv_fingerprint", "must name the asking engine's KV layout")
    if msg.block_size < 1:
        raise InvalidArgumentError("block_size", f"must be >= 1, got {msg.block_size}")
    for i, h in enumerate(msg.block_hashes):
        if len(h) != BLOCK_HASH_BYTES:
            raise InvalidArgumentError(
                f"block_hashes[{i}]", f"must be {BLOCK_HASH_BYTES} bytes, got {len(h)}"
            )
    return PrefixQuery(msg.kv_fingerprint, msg.block_size, tuple(msg.block_hashes))


def cached_prefix_response(num_blocks: int) -> decode_pb2.CachedPrefixResponse:
    return decode_pb2.CachedPrefixResponse(num_blocks=num_blocks)


def cached_blocks_from_proto(msg: decode_pb2.CachedPrefixResponse, query: PrefixQuery) -> int:
    """The answer's block count, never more than the query asked about."""
    return min(int(msg.num_blocks), len(query.block_hashes))
