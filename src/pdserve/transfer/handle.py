"""Where a hand-off's KV lies: ``KVLocation``, the worker's side of ``pdserve.v1.KVHandle``
(``convert.kv`` maps the two).

Every hand-off carries a capability, 16 random bytes (``transfer.stamp``): a store or direct
entry's key ends with their hex (``kvstore.keys.handoff_key``), so naming the entry takes
knowing them, and an shm segment holds them. Only the prefill worker that wrote the KV and
whoever it answered (the router, then the decode worker) know them.

Torch-free (the router and the policy import it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class TransportKind(StrEnum):
    """How the KV gets from prefill to decode. Values are the ``Timing.transport`` names."""

    STORE = "store"
    """Through the KVStore service (put by prefill, get by decode)."""
    DIRECT = "direct"
    """Streamed by the prefill worker straight into the decode worker (``Decode.Push``)."""
    SHM = "shm"
    """A POSIX shared-memory segment; prefill and decode on the same host."""
    RECOMPUTE = "recompute"
    """Nothing moves: the decode worker prefills the prompt again."""
    NIXL = "nixl"
    """One-sided NIXL reads by the decode worker out of the prefill worker's registered KV
    blocks (``transfer.nixl``, the ``pdserve[nixl]`` extra)."""
    NATIVE = "native"
    """The engines move it themselves (TensorRT-LLM's cache transceiver): pdserve carries only
    the handle (``NativeKV``)."""


@dataclass(frozen=True, slots=True)
class NativeKV:
    """A prefill's KV held by an engine that moves it itself (``pdserve.v1.NativeLocation``).

    The fields are those of TensorRT-LLM's disaggregated parameters: the context request's id,
    the first token(s) it produced, and the engine's own state for the transfer (the cache
    transceiver's connection details), opaque to pdserve.
    """

    backend: str
    """The backend that wrote it (``backends.BACKEND_NAMES``); another one refuses it."""
    ctx_request_id: int
    first_gen_tokens: tuple[int, ...]
    opaque_state: bytes = b""
    draft_tokens: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class KVLocation:
    """Where a request's prompt KV is (the ``KVHandle`` of the RPC): what a sender's ``planned``
    and ``commit`` describe and what a receiver is made for."""

    kind: TransportKind
    request_id: str
    num_tokens: int
    """Tokens whose KV the payload holds (the prompt length, less ``prefix_tokens``)."""
    num_bytes: int
    """Size of the payload as it lies there (layer stream, or shm segment)."""
    model_fingerprint: str
    """``kv_payload.kv_fingerprint`` of the writer; a reader with another one refuses it."""
    address: str = ""
    """store: host:port of the KV store holding it; direct: of the decode worker it was
    pushed to."""
    key: str = ""
    """store/direct: the entry's key; shm: the segment's name; fake: the hub's key."""
    host: str = ""
    """shm: the writer's host name; nixl: the prefill worker's host (its link's far end)."""
    offset: int = 0
    length: int = 0
    generation: int = 0
    """shm: the hand-off's generation in a reused slot (``transfer.shm.slots``); 0: one-off."""
    reason: str = ""
    """recompute: why nothing moved."""
    blocks: tuple[int, ...] = ()
    """nixl: the ids of the prefill worker's registered blocks the payload lies in, in order
    (``address``: its NIXL agent; ``key``: the fingerprint of the agent metadata its
    heartbeat publishes; ``length``: the payload's bytes in them)."""
    prefix_tokens: int = 0
    """Leading prompt tokens left out of the payload: the decode worker's prefix cache holds
    them (``prefix.DecodePrefix``). ``prefix_tokens + num_tokens`` is the prompt length."""
    capability: bytes = field(default=b"", repr=False)
    """The hand-off's capability (module docstring); recompute: that of the hand-off that
    fell back, if one began (it lets the decode worker drop that hand-off's prefetch)."""
    native: NativeKV | None = None
    """native: the handle of the KV the prefill worker's engine keeps for its own transfer
    (no capability: the engines' own transfer carries none of pdserve's)."""

    @classmethod
    def recompute(
        cls,
        request_id: str,
        num_tokens: int,
        fingerprint: str,
        reason: str,
        capability: bytes = b"",
    ) -> KVLocation:
        """Nothing moved: the decode worker prefills the prompt itself."""
        return cls(
            TransportKind.RECOMPUTE, request_id, num_tokens, 0, fingerprint, reason=reason,
            capability=capability,
        )  # fmt: skip

    @classmethod
    def of_native(
        cls, request_id: str, num_tokens: int, fingerprint: str, native: NativeKV
    ) -> KVLocation:
        """The engine keeps the KV; the decode worker's engine pulls it (``native``)."""
        return cls(TransportKind.NATIVE, request_id, num_tokens, 0, fingerprint, native=native)
