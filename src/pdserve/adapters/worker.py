"""The worker services' requests and answers: a request message -> ``EngineRequest`` (built
once, here), ``PrefillResult`` -> ``PrefillResponse``, ``DecodeDelta`` -> ``DecodeChunk``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from pdserve.convert import sampling_from_proto
from pdserve.convert.common import finish_reason_to_proto, timing_to_proto
from pdserve.convert.kv import handle_to_proto, transfer_to_proto
from pdserve.convert.logprobs import prompt_to_proto, top_to_proto, tops_to_proto
from pdserve.engine.request import EngineRequest
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2
from pdserve.worker.delta import DecodeDelta
from pdserve.worker.prefill import PrefillResult


class RequestMessage(Protocol):
    """The fields every worker request message has (Prefill, Decode, Mixed)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def sampling(self) -> common_pb2.SamplingParams: ...
    @property
    def tenant(self) -> str: ...
    @property
    def reservation_id(self) -> str: ...


def engine_request(message: RequestMessage, time_remaining: float | None) -> EngineRequest:
    """The request a worker message carries; ``time_remaining``: the call's
    (``ServicerContext.time_remaining()``), None without a deadline."""
    return EngineRequest(
        request_id=message.request_id,
        prompt_ids=tuple(message.prompt_token_ids),
        params=sampling_from_proto(message.sampling),
        tenant=message.tenant,
        reservation_id=message.reservation_id,
        deadline=None if time_remaining is None else time.monotonic() + time_remaining,
    )


def prefill_response(result: PrefillResult) -> prefill_pb2.PrefillResponse:
    """The answer to ``Prefill.Prefill``: the first token, the KV's handle, the figures."""
    t = result.timing
    response = prefill_pb2.PrefillResponse(
        first_token_id=result.first_token_id,
        first_logprob=result.first_logprob,
        finish_reason=finish_reason_to_proto(result.finish_reason),
        queue_ms=t.queue_ms,
        compute_ms=t.prefill_ms,
        transfer_ms=t.transfer_ms,
        transfer_bytes=t.transfer_bytes,
        num_cached_tokens=result.num_cached_tokens,
    )
    if result.kv is not None:
        response.kv.CopyFrom(handle_to_proto(result.kv))
    if result.transfer is not None:
        response.transfer.CopyFrom(transfer_to_proto(result.transfer))
    if result.first_top_logprobs is not None:
        response.first_top_logprobs.CopyFrom(top_to_proto(result.first_top_logprobs))
    if result.prompt_logprobs is not None:
        response.prompt_logprobs.CopyFrom(prompt_to_proto(result.prompt_logprobs))
    return response


def chunk_to_proto(delta: DecodeDelta) -> decode_pb2.DecodeChunk:
    """One ``Decode.Decode`` / ``Mixed.Generate`` chunk; the last one carries the timing."""
    chunk = decode_pb2.DecodeChunk(
        token_ids=delta.token_ids,
        logprobs=delta.logprobs,
        finish_reason=finish_reason_to_proto(delta.finish_reason),
        num_cached_tokens=delta.num_cached_tokens,
        top_logprobs=tops_to_proto(delta.top_logprobs),
    )
    if delta.prompt_logprobs is not None:
        chunk.prompt_logprobs.CopyFrom(prompt_to_proto(delta.prompt_logprobs))
    if delta.finished is not None:
        chunk.timing.CopyFrom(timing_to_proto(delta.finished.timing))
        if delta.finished.transfer is not None:
            chunk.timing.transfer.CopyFrom(transfer_to_proto(delta.finished.transfer))
    return chunk
