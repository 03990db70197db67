"""Translations between pdserve.v1 messages and the worker's library types.

Shared by the Prefill, Decode and Mixed servicers so that each of them stays a thin mapping.
Sampling parameters and finish reasons use the project-wide ``pdserve.rpc.convert``.
"""

from __future__ import annotations

from pdserve.errors import InvalidArgumentError
from pdserve.rpc.convert import finish_reason_to_proto, sampling_from_proto
from pdserve.v1 import common_pb2, decode_pb2
from pdserve.worker.decode import DecodeDelta, StreamTiming
from pdserve.worker.handoff import StoredKV

__all__ = [
    "chunk_to_proto",
    "finish_reason_to_proto",
    "handle_from_proto",
    "handle_to_proto",
    "sampling_from_proto",
    "timing_to_proto",
]


def handle_to_proto(kv: StoredKV) -> common_pb2.KVHandle:
    handle = common_pb2.KVHandle(
        request_id=kv.request_id,
        num_tokens=kv.num_tokens,
        num_bytes=kv.num_bytes,
        model_fingerprint=kv.model_fingerprint,
        store=common_pb2.StoreLocation(address=kv.address, key=kv.key),
    )
    if kv.checksum is not None:
        handle.checksum = kv.checksum
    return handle


def handle_from_proto(handle: common_pb2.KVHandle) -> StoredKV:
    """A store-located handle; the other locations are not served by this worker yet."""
    location = handle.WhichOneof("location")
    if location != "store":
        raise InvalidArgumentError(
            "kv.location", f"this worker reads KV from a KV store only, got {location or 'none'}"
        )
    if not handle.store.key:
        raise InvalidArgumentError("kv.store.key", "must not be empty")
    return StoredKV(
        request_id=handle.request_id,
        address=handle.store.address,
        key=handle.store.key,
        num_tokens=handle.num_tokens,
        num_bytes=handle.num_bytes,
        model_fingerprint=handle.model_fingerprint,
        checksum=handle.checksum if handle.HasField("checksum") else None,
    )


def timing_to_proto(t: StreamTiming) -> common_pb2.Timing:
    return common_pb2.Timing(
        queue_ms=t.queue_ms,
        prefill_ms=t.prefill_ms,
        transfer_ms=t.transfer_ms,
        decode_ms=t.decode_ms,
        ttft_ms=t.ttft_ms,
        e2e_ms=t.e2e_ms,
        transfer_bytes=t.transfer_bytes,
        transport=t.transport,
    )


def chunk_to_proto(delta: DecodeDelta) -> decode_pb2.DecodeChunk:
    chunk = decode_pb2.DecodeChunk(
        token_ids=delta.token_ids,
        logprobs=delta.logprobs,
        finish_reason=finish_reason_to_proto(delta.finish_reason),
        num_cached_tokens=delta.num_cached_tokens,
    )
    if delta.timing is not None:
        chunk.timing.CopyFrom(timing_to_proto(delta.timing))
    return chunk
