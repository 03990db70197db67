"""DecodeWorker: continue prefilled requests from their handed-over KV, or run whole requests.

``decode`` (the Decode service): fetch the payload from the KV store named in the handle,
reading it with ``delete_after_read`` so the store entry goes away as it is consumed, or
deleting it explicitly if the fetch fails or is cancelled; check it; import it into the engine
with the prefill's first token; stream the tokens after that first token.

``generate`` (the Mixed service): prefill and decode in this worker's engine, which
interleaves the prompt's chunks with the running decodes; the stream starts with the first
token.

Closing a stream early (a cancelled RPC) aborts the request: its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.outputs import FinishReason, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import (
    InvalidArgumentError,
    KVPayloadMismatchError,
    KVTransferError,
    PdServeError,
)
from pdserve.kvstore.client import KVStoreClient
from pdserve.worker.async_engine import AsyncEngine
from pdserve.worker.handoff import StoredKV
from pdserve.worker.heartbeat import kv_fingerprint
from pdserve.worker.prefill import check_request
from pdserve.worker.timing import RequestTiming

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """Where the time of one streamed request went (milliseconds); sent with the last delta."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    transfer_bytes: int = 0
    transport: str = ""


@dataclass(frozen=True, slots=True)
class DecodeDelta:
    """The tokens of one engine step for one request."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    """Set on the last delta only."""
    timing: StreamTiming | None = None
    """Set on the last delta only."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (``generate``, last delta only)."""


class DecodeWorker:
    """Streams decodes (and colocated generations) from one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, *, store_timeout_s: float = 10.0) -> None:
        self.engine = engine
        self.store_timeout_s = store_timeout_s
        self.fingerprint = kv_fingerprint(engine.layout)
        self._stores: dict[str, KVStoreClient] = {}

    async def close(self) -> None:
        """Close the KV store connections."""
        stores, self._stores = self._stores, {}
        for client in stores.values():
            await client.close()

    def _store(self, address: str) -> KVStoreClient:
        client = self._stores.get(address)
        if client is None:
            client = self._stores[address] = KVStoreClient(address, timeout_s=self.store_timeout_s)
        return client

    # -- Decode ----------------------------------------------------------------------------
    async def decode(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        first_token: tuple[int, float],
        params: SamplingParams,
        kv: StoredKV,
        *,
        tenant: str = "",
        reservation_id: str = "",
    ) -> AsyncGenerator[DecodeDelta, None]:
        """The tokens after ``first_token``; the store entry is gone when this ends, always."""
        started = time.perf_counter()
        client = self._store(kv.address) if kv.address else None
        consumed = False
        try:
            if client is None:
                raise InvalidArgumentError("kv.store.address", "must be the KV store's host:port")
            check_request(self.engine, request_id, prompt_ids, params)
            if kv.model_fingerprint != self.fingerprint:
                raise KVPayloadMismatchError(
                    f"KV handle fingerprint {kv.model_fingerprint!r} differs from this "
                    f"worker's {self.fingerprint!r}"
                )
            if kv.num_tokens != len(prompt_ids):
                raise InvalidArgumentError(
                    "kv.num_tokens", f"{kv.num_tokens}, but the prompt has {len(prompt_ids)} tokens"
                )
            # Reading with delete_after_read: a completed read has deleted the entry.
            blob = await client.get(kv.key, delete_after_read=True)
            consumed = True
        finally:
            if not consumed and client is not None:
                await self._delete_entry(client, kv.key)
        payload = await asyncio.to_thread(_check_payload, blob, kv)
        transfer_ms = (time.perf_counter() - started) * 1000.0

        timing = RequestTiming()
        stream = self.engine.generate(
            request_id,
            prompt_ids,
            params,
            cache_salt=tenant,
            kv=payload,
            first_token=first_token,
            tag=reservation_id,
            timing=timing,
        )
        async with aclosing(stream):
            async for out in stream:
                final = None
                if out.finished:
                    final = StreamTiming(
                        queue_ms=timing.queue_ms,
                        transfer_ms=transfer_ms,
                        decode_ms=timing.steps_ms,
                        e2e_ms=(time.perf_counter() - started) * 1000.0,
                        transfer_bytes=len(blob),
                        transport="store",
                    )
                yield _delta(out, final, num_cached_tokens=0)

    async def _delete_entry(self, client: KVStoreClient, key: str) -> None:
        """Delete a payload this worker will not consume; on failure its lease ends it."""
        try:
            await client.delete(key)
        except PdServeError as err:
            logger.warning("could not delete KV payload %r (its lease will expire): %s", key, err)

    # -- Mixed -----------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        tenant: str = "",
        reservation_id: str = "",
    ) -> AsyncGenerator[DecodeDelta, None]:
        """Prefill and decode here; the first delta carries the first token."""
        check_request(self.engine, request_id, prompt_ids, params)
        timing = RequestTiming()
        stream = self.engine.generate(
            request_id, prompt_ids, params, cache_salt=tenant, tag=reservation_id, timing=timing
        )
        async with aclosing(stream):
            async for out in stream:
                final = None
                if out.finished:
                    final = StreamTiming(
                        queue_ms=timing.queue_ms,
                        prefill_ms=timing.first_output_ms,
                        decode_ms=timing.after_first_ms,
                        ttft_ms=timing.ttft_ms,
                        e2e_ms=timing.e2e_ms,
                    )
                yield _delta(
                    out, final, num_cached_tokens=out.num_cached_tokens if out.finished else 0
                )


def _check_payload(blob: bytes, kv: StoredKV) -> KVPayload:
    """Size, checksum and format of a fetched payload (CPU work: run it off the loop)."""
    if len(blob) != kv.num_bytes:
        raise KVTransferError(
            f"KV payload of {kv.request_id!r} is {len(blob)} bytes, handle says {kv.num_bytes}"
        )
    if kv.checksum is not None and zlib.crc32(blob) != kv.checksum:
        raise KVTransferError(f"KV payload of {kv.request_id!r} failed the handle's CRC-32 check")
    payload = KVPayload.from_bytes(blob)
    if payload.num_tokens != kv.num_tokens:
        raise KVPayloadMismatchError(
            f"KV payload holds {payload.num_tokens} tokens, the handle says {kv.num_tokens}"
        )
    return payload


def _delta(
    out: RequestOutput, timing: StreamTiming | None, *, num_cached_tokens: int
) -> DecodeDelta:
    return DecodeDelta(
        token_ids=list(out.new_token_ids),
        logprobs=list(out.new_logprobs),
        finish_reason=out.finish_reason if out.finished else None,
        timing=timing,
        num_cached_tokens=num_cached_tokens,
    )
