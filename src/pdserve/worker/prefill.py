"""PrefillWorker: compute a prompt's KV and first token, park the KV in a KV store.

Per request:
  1. Check the request against the model (the full ``max_tokens`` included, so that a request
     the decode side would refuse fails here, before any compute).
  2. Run the prompt with ``hold_kv`` and ``max_tokens=1``: the first token is sampled with the
     request's own parameters (temperature, seed, ...); the blocks stay held.
  3. If that token already ends the request (a stop token or string, ``max_tokens == 1``, the
     model's length), free the blocks and report the finish: there is nothing to decode.
  4. Otherwise export the KV and free the blocks in one engine turn, serialize it, and put it
     into the store under ``kv/{request_id}`` with a lease. The blocks are freed on every path
     (error, cancellation) by ``finally``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import zlib
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass

from pdserve.engine.outputs import FinishReason, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError, KVTransferError, PdServeError
from pdserve.kvstore.client import KVStoreClient
from pdserve.rpc.convert import check_sampling_against, check_token_ids
from pdserve.worker.async_engine import AsyncEngine
from pdserve.worker.handoff import StoredKV, store_key
from pdserve.worker.heartbeat import kv_fingerprint
from pdserve.worker.timing import RequestTiming

logger = logging.getLogger(__name__)


def check_request(
    engine: AsyncEngine, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
) -> None:
    """Raise ``InvalidArgumentError`` naming the (proto) field the engine would refuse."""
    if not request_id:
        raise InvalidArgumentError("request_id", "must not be empty")
    check_token_ids(prompt_ids, vocab_size=engine.vocab_size, field="prompt_token_ids")
    if len(prompt_ids) >= engine.max_model_len:
        raise InvalidArgumentError(
            "prompt_token_ids",
            f"{len(prompt_ids)} tokens; the model's maximum length is {engine.max_model_len}",
        )
    check_sampling_against(
        params,
        vocab_size=engine.vocab_size,
        max_model_len=engine.max_model_len,
        prompt_len=len(prompt_ids),
    )


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """The first token, where its KV went, and where the time went."""

    first_token_id: int
    first_logprob: float
    kv: StoredKV | None
    """None when ``finish_reason`` is set (nothing left to decode)."""
    finish_reason: FinishReason | None
    queue_ms: float
    compute_ms: float
    transfer_ms: float
    """Export, serialization and the put into the store."""
    transfer_bytes: int
    num_cached_tokens: int


class PrefillWorker:
    """Runs prefills on one AsyncEngine and hands their KV over through one KV store."""

    def __init__(self, engine: AsyncEngine, store: KVStoreClient, *, lease_s: float = 60.0) -> None:
        if not lease_s > 0:
            raise InvalidArgumentError("lease_s", f"must be > 0, got {lease_s}")
        self.engine = engine
        self.store = store
        self.lease_s = lease_s
        self.fingerprint = kv_fingerprint(engine.layout)

    async def prefill(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        tenant: str = "",
        reservation_id: str = "",
    ) -> PrefillResult:
        check_request(self.engine, request_id, prompt_ids, params)
        timing = RequestTiming()
        # Until export_and_release returns, the engine may hold this request's blocks (also when
        # we are cancelled between its finish and our reading of it): abort is a no-op for an
        # id the engine no longer knows, so always abort unless the release is done.
        held = True
        put_key: str | None = None  # set once a put may have reached the store
        try:
            last: RequestOutput | None = None
            stream = self.engine.generate(
                request_id,
                prompt_ids,
                dataclasses.replace(params, max_tokens=1),
                hold_kv=True,
                cache_salt=tenant,
                tag=reservation_id,
                timing=timing,
            )
            async with aclosing(stream):
                async for out in stream:
                    last = out
            if last is None or not last.new_token_ids:
                raise KVTransferError(f"prefill of {request_id!r} produced no first token")
            token, logprob = last.new_token_ids[0], last.new_logprobs[0]
            reason = self._finish_reason(last, params, len(prompt_ids))
            stored: StoredKV | None = None
            started = time.perf_counter()
            if reason is None:
                payload = await self.engine.export_and_release(request_id)
                held = False
                blob = await asyncio.to_thread(payload.to_bytes)
                key = put_key = store_key(request_id)
                await self.store.put(key, blob, self.lease_s)
                put_key = None  # stored: from here the decode side owns the entry
                stored = StoredKV(
                    request_id=request_id,
                    address=self.store.address,
                    key=key,
                    num_tokens=payload.num_tokens,
                    num_bytes=len(blob),
                    model_fingerprint=self.fingerprint,
                    checksum=zlib.crc32(blob),
                )
            return PrefillResult(
                first_token_id=token,
                first_logprob=logprob,
                kv=stored,
                finish_reason=reason,
                queue_ms=timing.queue_ms,
                compute_ms=timing.first_output_ms,
                transfer_ms=(time.perf_counter() - started) * 1000.0 if stored else 0.0,
                transfer_bytes=stored.num_bytes if stored else 0,
                num_cached_tokens=last.num_cached_tokens,
            )
        finally:
            if held:
                self.engine.abort(request_id)  # releases the held blocks
            if put_key is not None:  # cancelled or failed mid-put: the entry may exist
                await asyncio.shield(self._delete_quietly(put_key))

    async def _delete_quietly(self, key: str) -> None:
        try:
            await self.store.delete(key)
        except PdServeError as err:  # the lease reclaims it; say so rather than hide it
            logger.warning("could not delete %s after a failed put (%s); its lease will", key, err)

    def _finish_reason(
        self, out: RequestOutput, params: SamplingParams, prompt_len: int
    ) -> FinishReason | None:
        """Whether the first token ends the request under its real ``max_tokens``."""
        if out.finish_reason is FinishReason.STOP:
            return FinishReason.STOP
        if params.max_tokens <= 1 or prompt_len + 1 >= self.engine.max_model_len:
            return FinishReason.LENGTH
        return None
