"""DecodeWorker: continue prefilled requests from their handed-over KV, or run whole requests.

``decode`` (the Decode service): the request's hand-off is taken in through the worker's
``DecodeConnector`` (``handoff.decode``: the KV received, read early, or recomputed when it
does not come; the transport's copy freed whatever happens), checked against the model, then
imported with the prefill's first token, and the tokens after it stream out. With ``resumed``
tokens (a request migrating from a decode worker that died mid-stream) the prompt, the first
token and those are prefilled together and the request continues after them
(``worker.migration``).

``generate`` (the Mixed service): prefill and decode in this worker's engine, which
interleaves the prompt's chunks with the running decodes; the stream starts with the first
token.

Closing a stream early (a cancelled RPC) aborts the request: its blocks are freed at once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import replace

from pdserve.backends import EngineBackend
from pdserve.engine.request import EngineRequest
from pdserve.handoff import DecodeConnector
from pdserve.timing import RequestTiming
from pdserve.transfer.base import KVLocation
from pdserve.worker.delta import DecodeDelta, Finished, delta_of
from pdserve.worker.migration import Resumed, resume
from pdserve.worker.prefill import check_request


class DecodeWorker:
    """Streams decodes (and colocated generations) from one engine backend; its hand-offs
    come in through its ``connector``, which it owns."""

    def __init__(self, engine: EngineBackend, connector: DecodeConnector) -> None:
        self.engine = engine
        self.connector = connector
        self.fingerprint = engine.fingerprint

    async def close(self) -> None:
        """Close the connector (its reads, pushed hand-offs and connections)."""
        await self.connector.close()

    # -- Decode ----------------------------------------------------------------------------
    async def decode(
        self,
        request: EngineRequest,
        first_token: tuple[int, float],
        kv: KVLocation,
        *,
        resumed: Sequence[int] = (),
    ) -> AsyncGenerator[DecodeDelta, None]:
        """The tokens after ``first_token`` (and after ``resumed``, the tokens a decode worker
        that died had streamed); the transport's copy is gone when this ends."""
        # The prompt's logprobs went out with the prefill's answer.
        request = replace(request, params=request.params.without_prompt_logprobs())
        if resumed:
            check_request(self.engine, request)
            deltas = resume(
                self.engine, self.fingerprint, Resumed(request, [first_token[0], *resumed], kv)
            )
            async with aclosing(deltas):
                async for delta in deltas:
                    yield delta
            return
        started = time.perf_counter()
        async with self.connector.incoming(kv) as incoming:  # a refused request frees it too
            check_request(self.engine, request)
            arrival = await incoming.arrive(request)

        timing = RequestTiming()
        stream = self.engine.decode(
            request,
            first_token,
            arrival.payload,
            timing=timing,
            coalesce=True,  # a stream that fell behind catches up in one chunk
        )
        async with aclosing(stream):
            async for out in stream:
                final = None
                if out.finished:
                    figures = timing.decode(
                        started=started,
                        recompute_ms=arrival.recompute_ms,
                        transfer_ms=arrival.transfer_ms,
                        transfer_bytes=arrival.record.num_bytes,
                        transport=arrival.record.transport,
                    )
                    final = Finished(figures, timing, arrival.record)
                yield delta_of(out, final, num_cached_tokens=0)

    # -- Mixed -----------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncGenerator[DecodeDelta, None]:
        """Prefill and decode here; the first delta carries the first token."""
        check_request(self.engine, request)
        timing = RequestTiming()
        stream = self.engine.generate(request, timing=timing)
        async with aclosing(stream):
            async for out in stream:
                final = None
                if out.finished:
                    final = Finished(timing.generate(), timing)
                yield delta_of(
                    out, final, num_cached_tokens=out.num_cached_tokens if out.finished else 0
                )
