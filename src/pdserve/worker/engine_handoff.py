"""Prefill hand-offs that move no KV bytes through pdserve.

A backend whose KV cannot leave the engine as bytes (``features.kv_payload`` false, as
TensorRT-LLM's) hands over ``native``ly: its engine keeps the prompt's KV for its own transfer
and the ``KVHandle`` carries only the engine's handle (``NativeKV``), which the decode worker's
engine of the same backend uses to pull it. Asked for ``recompute``, it frees the KV and the
decode worker computes the prompt again. pdserve's transports (store, direct, shm) are refused
for it, naming the field. A backend with no native transfer refuses ``native``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.backends import EngineBackend, Handoff
from pdserve.engine.outputs import FinishReason, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError, KVTransferError
from pdserve.timing import RequestTiming
from pdserve.transfer.base import HandoffRecord, KVLocation, TransportKind


def finish_at_first(
    out: RequestOutput, params: SamplingParams, prompt_len: int, max_model_len: int
) -> FinishReason | None:
    """Whether the first token ends the request under its real ``max_tokens``."""
    if out.finish_reason is FinishReason.STOP:
        return FinishReason.STOP
    if params.max_tokens <= 1 or prompt_len + 1 >= max_model_len:
        return FinishReason.LENGTH
    return None


def in_engine_kind(backend: EngineBackend, asked: TransportKind | None) -> TransportKind | None:
    """The kind of a hand-off the engine makes (native, or recompute on a backend whose KV
    cannot leave it); None: pdserve's transports carry the KV. ``asked``: the transport the
    request or the worker's options name (None: auto)."""
    f = backend.features
    if asked is TransportKind.NATIVE and not f.native_kv:
        raise InvalidArgumentError(
            "transport", f"the {backend.name} backend has no native KV transfer"
        )
    if f.kv_payload and asked is not TransportKind.NATIVE:
        return None
    if asked in (None, TransportKind.NATIVE, TransportKind.RECOMPUTE):
        return asked or TransportKind.NATIVE
    raise InvalidArgumentError(
        "transport",
        f"the {backend.name} backend's KV cannot leave its engine as bytes, so {asked} cannot "
        "carry it: use native (or recompute)",
    )


@dataclass(frozen=True, slots=True)
class InEngine:
    """A prefill whose KV stayed in the engine (``location`` None: the request finished)."""

    output: RequestOutput
    finish_reason: FinishReason | None
    location: KVLocation | None
    record: HandoffRecord | None
    timing: RequestTiming


async def prefill_in_engine(
    backend: EngineBackend,
    request_id: str,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    kind: TransportKind,
    *,
    tenant: str = "",
    reservation_id: str = "",
) -> InEngine:
    """Prefill with the engine keeping the KV for its own transfer (``native``) or freeing it
    (``recompute``, or when the first token ends the request)."""
    n, timing = len(prompt_ids), RequestTiming()
    decodes = params.max_tokens > 1 and n + 1 < backend.max_model_len
    native = kind is TransportKind.NATIVE and decodes
    done = await backend.prefill(
        request_id,
        prompt_ids,
        params,
        handoff=Handoff.NATIVE if native else Handoff.RELEASE,
        cache_salt=tenant,
        tag=reservation_id,
        timing=timing,
    )
    out = done.output
    if not out.new_token_ids:
        raise KVTransferError(f"prefill of {request_id!r} produced no first token")
    reason = finish_at_first(out, params, n, backend.max_model_len)
    if reason is not None:
        return InEngine(out, reason, None, None, timing)
    if native:
        if done.native is None:
            raise KVTransferError(f"the engine kept no KV for {request_id!r}")
        location = KVLocation.of_native(request_id, n, backend.fingerprint, done.native)
        return InEngine(out, None, location, HandoffRecord(TransportKind.NATIVE.value), timing)
    why = "recompute was asked for"
    location = KVLocation.recompute(request_id, n, backend.fingerprint, why)
    record = HandoffRecord(TransportKind.RECOMPUTE.value, fallback_reason=why)
    return InEngine(out, None, location, record, timing)
