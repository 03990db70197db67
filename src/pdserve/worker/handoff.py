"""What a prefill worker hands to a decode worker: where the KV lies and how to check it."""

from __future__ import annotations

from dataclasses import dataclass

STORE_KEY_PREFIX = "kv/"


def store_key(request_id: str) -> str:
    """The KV store key of a request's prompt KV."""
    return f"{STORE_KEY_PREFIX}{request_id}"


@dataclass(frozen=True, slots=True)
class StoredKV:
    """A request's prompt KV in a KV store (``KVHandle`` with a store location)."""

    request_id: str
    address: str
    """host:port of the KVStore service."""
    key: str
    num_tokens: int
    """Tokens whose KV the payload holds (the prompt length)."""
    num_bytes: int
    """Size of the payload (``KVPayload.to_bytes()``)."""
    model_fingerprint: str
    """``heartbeat.kv_fingerprint`` of the writer; a reader with another one refuses it."""
    checksum: int | None
    """``zlib.crc32`` of the payload bytes; None when the writer did not compute one."""
