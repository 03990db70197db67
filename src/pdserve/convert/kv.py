"""The KV handle (``KVLocation``) and the hand-off's measurements (``HandoffRecord``)."""

from __future__ import annotations

from pdserve.errors import InvalidArgumentError
from pdserve.transfer.base import HandoffRecord, KVLocation, NativeKV, TransportKind
from pdserve.transfer.stamp import CAPABILITY_BYTES
from pdserve.v1 import common_pb2


def handle_to_proto(kv: KVLocation) -> common_pb2.KVHandle:
    handle = common_pb2.KVHandle(
        request_id=kv.request_id,
        num_tokens=kv.num_tokens,
        num_bytes=kv.num_bytes,
        model_fingerprint=kv.model_fingerprint,
        prefix_tokens=kv.prefix_tokens,
        capability=kv.capability,
    )
    if kv.kind is TransportKind.STORE:
        handle.store.CopyFrom(common_pb2.StoreLocation(address=kv.address, key=kv.key))
    elif kv.kind is TransportKind.DIRECT:
        handle.direct.CopyFrom(common_pb2.DirectLocation(address=kv.address, key=kv.key))
    elif kv.kind is TransportKind.SHM:
        handle.shm.CopyFrom(
            common_pb2.ShmLocation(
                host=kv.host,
                name=kv.key,
                offset=kv.offset,
                length=kv.length,
                generation=kv.generation,
            )
        )
    elif kv.kind is TransportKind.NIXL:
        handle.nixl.CopyFrom(
            common_pb2.NixlLocation(
                agent=kv.address,
                metadata_fingerprint=kv.key,
                host=kv.host,
                length=kv.length,
                blocks=kv.blocks,
            )
        )
    elif kv.kind is TransportKind.NATIVE and kv.native is not None:
        n = kv.native
        handle.native.CopyFrom(
            common_pb2.NativeLocation(
                opaque_state=n.opaque_state,
                backend=n.backend,
                ctx_request_id=n.ctx_request_id,
                first_gen_tokens=n.first_gen_tokens,
                draft_tokens=n.draft_tokens,
            )
        )
    else:
        handle.recompute.CopyFrom(common_pb2.RecomputeLocation(reason=kv.reason))
    return handle


def _capability(handle: common_pb2.KVHandle, required: bool) -> bytes:
    cap = bytes(handle.capability)
    if (required or cap) and len(cap) != CAPABILITY_BYTES:
        raise InvalidArgumentError(
            "kv.capability", f"must be {CAPABILITY_BYTES} bytes, got {len(cap)}"
        )
    return cap


def handle_from_proto(handle: common_pb2.KVHandle) -> KVLocation:
    """The location of a handle; ``InvalidArgumentError`` names a missing or empty field (a
    handle of moved KV must carry its 16-byte capability)."""
    where = handle.WhichOneof("location")
    common = (handle.request_id, handle.num_tokens, handle.num_bytes, handle.model_fingerprint)
    skip = handle.prefix_tokens
    if where in ("store", "direct"):
        loc = handle.store if where == "store" else handle.direct
        if not loc.key:
            raise InvalidArgumentError(f"kv.{where}.key", "must not be empty")
        kind = TransportKind.STORE if where == "store" else TransportKind.DIRECT
        return KVLocation(
            kind, *common, address=loc.address, key=loc.key, prefix_tokens=skip,
            capability=_capability(handle, True),
        )  # fmt: skip
    if where == "shm":
        shm = handle.shm
        if not shm.name:
            raise InvalidArgumentError("kv.shm.name", "must not be empty")
        return KVLocation(
            TransportKind.SHM, *common, key=shm.name, host=shm.host, offset=shm.offset,
            length=shm.length, generation=shm.generation, prefix_tokens=skip,
            capability=_capability(handle, True),
        )  # fmt: skip
    if where == "nixl":
        nx = handle.nixl
        if not nx.agent:
            raise InvalidArgumentError("kv.nixl.agent", "must name the prefill worker's agent")
        if not nx.metadata_fingerprint:
            raise InvalidArgumentError("kv.nixl.metadata_fingerprint", "must not be empty")
        if not nx.blocks:
            raise InvalidArgumentError("kv.nixl.blocks", "must name at least one block")
        return KVLocation(
            TransportKind.NIXL, *common, address=nx.agent, key=nx.metadata_fingerprint,
            host=nx.host, length=nx.length, blocks=tuple(nx.blocks), prefix_tokens=skip,
            capability=_capability(handle, True),
        )  # fmt: skip
    if where == "recompute":
        return KVLocation(
            TransportKind.RECOMPUTE, *common, reason=handle.recompute.reason,
            capability=_capability(handle, False),
        )  # fmt: skip
    if where == "native":
        n = handle.native
        if not n.backend:
            raise InvalidArgumentError("kv.native.backend", "must name the backend that wrote it")
        if not n.first_gen_tokens:
            raise InvalidArgumentError("kv.native.first_gen_tokens", "must not be empty")
        native = NativeKV(
            backend=n.backend,
            ctx_request_id=n.ctx_request_id,
            first_gen_tokens=tuple(n.first_gen_tokens),
            opaque_state=n.opaque_state,
            draft_tokens=tuple(n.draft_tokens),
        )
        return KVLocation(TransportKind.NATIVE, *common, native=native)
    raise InvalidArgumentError(
        "kv.location",
        f"must be store, direct, shm, nixl, native or recompute; got {where or 'none'}",
    )


def transfer_to_proto(r: HandoffRecord) -> common_pb2.TransferTiming:
    return common_pb2.TransferTiming(
        transport=r.transport,
        num_bytes=r.num_bytes,
        send_start_ns=r.send_start_ns,
        first_layer_ns=r.first_layer_ns,
        last_layer_ns=r.last_layer_ns,
        compute_end_ns=r.compute_end_ns,
        send_end_ns=r.send_end_ns,
        recv_start_ns=r.recv_start_ns,
        recv_end_ns=r.recv_end_ns,
        bytes_per_s=r.bytes_per_s,
        overlap_ms=r.overlap_ms,
        exposed_ms=r.exposed_ms,
        hook_ms=r.hook_ns / 1e6,
        recv_ms=r.recv_ms,
        compression=r.compression,
        layerwise=r.layerwise,
        fallback_reason=r.fallback_reason,
        wait_ms=r.wait_ms,
        prefetched=r.prefetched,
    )
