"""Continuing a request whose decode worker died mid-stream (the decode side of a migration).

The router knows every token the dead worker streamed. It sends them to another decode worker
with a ``recompute`` KV handle (``DecodeRequest.resumed_token_ids``): nothing of the old KV
survives, so this worker prefills the prompt and those tokens in one go, as its engine
recomputes a preempted sequence, and continues at the next output position. The tokens it had
are output tokens, not prompt: ``max_tokens`` counts them, seeded sampling draws by output
position (``engine.sampler.step_seed``), and stop strings see their text; the stream carries
only the tokens after them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from pdserve.backends import EngineBackend
from pdserve.engine.request import EngineRequest
from pdserve.errors import InvalidArgumentError, KVPayloadMismatchError
from pdserve.timing import RequestTiming
from pdserve.transfer.base import HandoffRecord, KVLocation, TransportKind
from pdserve.worker.delta import DecodeDelta, Finished, delta_of


@dataclass(frozen=True, slots=True)
class Resumed:
    """A migrated request and every output token streamed so far."""

    request: EngineRequest
    generated: Sequence[int]
    """The first token (the prefill's) and the ones the dead decode worker streamed."""
    kv: KVLocation
    """Must be a recompute handle; its fingerprint, when set, names the model that drew the
    tokens so far."""


async def resume(
    engine: EngineBackend,
    fingerprint: str,
    resumed: Resumed,
) -> AsyncGenerator[DecodeDelta, None]:
    """Recompute prompt + generated tokens on ``engine`` and stream the tokens after them.

    ``fingerprint``: this worker's KV fingerprint; another model's tokens are refused
    (``KVPayloadMismatchError``): it would not continue them as the first one would have.
    """
    started = time.perf_counter()
    kv, request = resumed.kv, resumed.request
    if kv.kind is not TransportKind.RECOMPUTE:
        raise InvalidArgumentError(
            "resumed_token_ids", f"only with a recompute KV handle, not {kv.kind}"
        )
    if kv.model_fingerprint and kv.model_fingerprint != fingerprint:
        raise KVPayloadMismatchError(
            f"request {request.request_id} was generated with model fingerprint "
            f"{kv.model_fingerprint!r}; this worker's is {fingerprint!r}"
        )
    timing = RequestTiming()
    record = HandoffRecord(TransportKind.RECOMPUTE.value, fallback_reason=kv.reason)
    stream = engine.generate(
        request,
        timing=timing,
        coalesce=True,
        generated=resumed.generated,
    )
    async with aclosing(stream):
        async for out in stream:
            final = None
            if out.finished:
                figures = timing.generate(started=started, transport=record.transport)
                final = Finished(figures, timing, record)
            yield delta_of(out, final, num_cached_tokens=0)
