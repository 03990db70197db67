"""``TensorRTLLMBackend``: TensorRT-LLM's LLM API as an ``EngineBackend``.

Written to the documented LLM API (``tensorrt_llm_api`` lists the surface) and imported
lazily: nothing touches ``tensorrt_llm`` until a backend is built.

* ``generate``: one ``generate_async(..., streaming=True)`` request.
* ``prefill``: a ``context_only`` request (``DisaggregatedParams``) with ``max_tokens=1``; the
  engine keeps the prompt's KV for its cache transceiver and the output's disaggregated
  params (context request id, first token, opaque transceiver state) become a ``NativeKV``,
  which travels in the ``KVHandle`` (``native`` location) to the decode worker.
* ``decode``: a ``generation_only`` request carrying those params back; TensorRT-LLM pulls the
  KV from the context instance itself. Its outputs are cumulative from the context phase's
  first token, which the backend leaves out (the prefill worker already streamed it).
  Without a handle (recompute) the prompt and the first token are run as one request.
* structured output: ``GuidedDecodingParams`` (``tensorrt_llm_sampling``), which TensorRT-LLM
  carries across its ``native`` hand-off itself; continued from tokens drawn elsewhere, refused.

TensorRT-LLM's LLM API has no call that reads or writes KV blocks, so pdserve's own
transports (store, direct, shm: ``KVPayload`` bytes) cannot carry its KV: ``Handoff.HOLD``,
layer hooks, ``export_kv`` and ``decode`` from a ``KVPayload`` are refused with
``InvalidArgumentError`` naming the field. Both sides of a hand-off must be tensorrt-llm
workers of the same checkpoint, which the fingerprint (``tensorrt-llm/...``) enforces.

The request's ``tenant`` is not passed on as a cache salt (not every release's
``generate_async`` takes one): tenants may share TensorRT-LLM's cached prompt blocks.

Capacity comes from the engine's iteration statistics (``get_stats_async``, which needs
``enable_iter_perf_stats``), read by a tracked task every ``stats_interval_s``; the engine
reports none before its first iteration, so ``start`` runs a one-token request and waits for
the first report. Queued tokens, running and waiting requests and reservation tags are
counted by the backend itself (a request is waiting until its first output): TensorRT-LLM's
own queue counts as compute in ``RequestTiming``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

from pdserve.backends.base import (
    TENSORRT_LLM,
    BackendFeatures,
    Capacity,
    Handoff,
    NativeKV,
    Prefilled,
    refuse,
)
from pdserve.backends.tensorrt_llm_api import (
    DEFAULT_BLOCK_SIZE,
    NO_BLOCK_ACCESS,
    KVStats,
    LLMApi,
    TensorRTLLMConfig,
    generation_params,
    kv_stats,
    load_api,
    native_of,
    read_shape,
)
from pdserve.backends.tensorrt_llm_requests import LiveRequests, finished_at_first
from pdserve.backends.tensorrt_llm_sampling import continued_guide, sampling_params
from pdserve.engine.gate import UNGATED, ComputeGate
from pdserve.engine.kv_payload import DTYPES, KVLayout, KVPayload, kv_fingerprint
from pdserve.engine.outputs import FinishReason, RequestOutput
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import LayerHook
from pdserve.errors import (
    InvalidArgumentError,
    KVTransferError,
    WorkerUnavailableError,
)
from pdserve.models.loader import checkpoint_fingerprint
from pdserve.timing import RequestTiming

logger = logging.getLogger(__name__)

FEATURES = BackendFeatures(kv_payload=False, layer_hook=False, prefix_cache=False, native_kv=True)
DEFAULT_MAX_NUM_TOKENS = 8192
"""TensorRT-LLM's default token budget of one iteration."""
FIRST_STATS_ROUNDS = 20
"""``start`` waits this many stats intervals for the engine's first report."""
MAX_FAILED_READS = 3
"""Statistics reads failing in a row after which the engine is taken for lost."""


class TensorRTLLMBackend:
    """A ``tensorrt_llm.LLM`` behind the ``EngineBackend`` protocol (see the module docstring)."""

    name = TENSORRT_LLM
    features = FEATURES
    gate: ComputeGate = UNGATED

    def __init__(
        self,
        llm: Any,
        api: LLMApi,
        layout: KVLayout,
        *,
        vocab_size: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int = 0,
        stats_interval_s: float = 0.5,
    ) -> None:
        self._llm = llm
        self._api = api
        self.layout = layout
        self.fingerprint = kv_fingerprint(layout)
        self.kv_bytes_per_token = layout.num_layers * layout.bytes_per_token_per_layer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        """0 where not configured: TensorRT-LLM sizes its batch itself."""
        self._stats_interval_s = stats_interval_s
        self._kv = KVStats(0, 0, layout.block_size)
        self._requests = LiveRequests()
        self._poller: asyncio.Task[None] | None = None
        self._closed = False
        self._fatal: BaseException | None = None
        self._fatal_waiters: list[asyncio.Future[BaseException]] = []

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        config: TensorRTLLMConfig | None = None,
        *,
        api: LLMApi | None = None,
    ) -> TensorRTLLMBackend:
        """Build the engine for a Hugging Face checkpoint (blocking: compiles and loads).
        ``WorkerUnavailableError`` when ``tensorrt_llm`` is not installed."""
        config = config or TensorRTLLMConfig()
        api = api or load_api()
        root = Path(model_dir)
        shape = read_shape(root)
        dtype = shape.dtype if config.dtype == "auto" else config.dtype
        layout = KVLayout(
            model_fingerprint=f"{TENSORRT_LLM}/{checkpoint_fingerprint(root)}",
            dtype=dtype if dtype in DTYPES else "bfloat16",
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            block_size=config.block_size or DEFAULT_BLOCK_SIZE,
        )
        llm = api.LLM(**config.llm_kwargs(api, root))
        return cls(
            llm,
            api,
            layout,
            vocab_size=shape.vocab_size,
            max_model_len=min(
                config.max_model_len or shape.max_position_embeddings,
                shape.max_position_embeddings,
            ),
            max_num_batched_tokens=config.max_num_batched_tokens or DEFAULT_MAX_NUM_TOKENS,
            max_num_seqs=config.max_num_seqs or 0,
            stats_interval_s=config.stats_interval_s,
        )

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Run one token through the engine, wait for its first statistics, poll them."""
        if self._poller is not None:
            return
        if self._closed:
            raise WorkerUnavailableError("the tensorrt-llm backend is closed")
        warm = self.generate(
            EngineRequest(
                "warm-up", (0,), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            )
        )
        async with contextlib.aclosing(warm):
            async for _ in warm:
                pass
        for _ in range(FIRST_STATS_ROUNDS):
            if await self._read_stats():
                break
            await asyncio.sleep(self._stats_interval_s)  # a timer: there is no stats signal
        else:
            raise WorkerUnavailableError(
                "tensorrt-llm reported no KV cache statistics after a first request "
                "(get_stats_async with enable_iter_perf_stats); the worker cannot report its "
                "capacity"
            )
        self._poller = asyncio.create_task(self._poll_stats(), name="tensorrt-llm-stats")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        self._requests.close()
        await asyncio.to_thread(self._llm.shutdown)

    async def failed(self) -> BaseException:
        """Wait until the engine is lost: its statistics failed ``MAX_FAILED_READS`` reads in
        a row (TensorRT-LLM offers no other signal of a dead engine through the LLM API)."""
        if self._fatal is not None:
            return self._fatal
        waiter: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self._fatal_waiters.append(waiter)
        try:
            return await waiter
        finally:
            self._fatal_waiters.remove(waiter)

    async def _poll_stats(self) -> None:
        failures = 0
        while True:
            try:
                await self._read_stats()
                failures = 0
            except Exception as err:  # one failed read must not end the polling
                failures += 1
                logger.exception("reading tensorrt-llm's iteration statistics failed")
                if failures >= MAX_FAILED_READS and self._fatal is None:
                    self._fatal = err
                    for waiter in self._fatal_waiters:
                        if not waiter.done():
                            waiter.set_result(err)
            await asyncio.sleep(self._stats_interval_s)  # a timer: there is no stats signal

    async def _read_stats(self) -> int:
        """Take every statistics item waiting; how many had KV cache figures."""
        found = 0
        try:
            async for stat in self._llm.get_stats_async(timeout=self._stats_interval_s):
                parsed = kv_stats(stat)
                if parsed is not None:
                    self._kv = parsed
                    found += 1
        except TimeoutError:  # nothing new within the interval: the figures stand
            pass
        return found

    # -- requests --------------------------------------------------------------------------
    def generate(
        self,
        request: EngineRequest,
        *,
        timing: RequestTiming | None = None,
        coalesce: bool = False,
        generated: Sequence[int] = (),
    ) -> AsyncGenerator[RequestOutput, None]:
        """``coalesce`` is moot: each output is cumulative, a late consumer skips nothing.
        ``generated`` tokens (a migrated request) join the prompt of one request that draws
        what is left of ``max_tokens``: greedy tokens continue as they would have, seeded
        sampling draws differ."""
        request_id, prompt_ids, params = request.request_id, request.prompt_ids, request.params
        reservation_id = request.reservation_id
        if generated:
            return self._continue(
                request_id,
                [*prompt_ids, *generated],
                params,
                len(generated),
                reservation_id,
                timing,
            )
        return self._requests.stream(
            request_id,
            prompt_ids,
            params,
            lambda: self._llm.generate_async(
                list(prompt_ids),
                sampling_params=self._sampling(params, len(prompt_ids)),
                streaming=True,
            ),
            reservation_id=reservation_id,
            timing=timing,
        )

    def _continue(
        self,
        request_id: str,
        tokens: list[int],
        params: SamplingParams,
        done: int,
        reservation_id: str,
        timing: RequestTiming | None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """A request whose first ``done`` output tokens (the end of ``tokens``) were drawn
        elsewhere: one request on all of ``tokens`` for the rest of ``max_tokens``."""
        if params.guide is not None:
            return refuse(continued_guide(params.guide))
        if params.max_tokens <= done:
            return finished_at_first(request_id, len(tokens) - done)
        rest = params.after(done)
        return self._requests.stream(
            request_id,
            tokens,
            rest,
            lambda: self._llm.generate_async(
                tokens,
                # The drawn tokens join the prompt, and still count as output for penalties.
                sampling_params=self._sampling(rest, len(tokens) - done),
                streaming=True,
            ),
            reservation_id=reservation_id,
            timing=timing,
        )

    async def prefill(
        self,
        request: EngineRequest,
        *,
        handoff: Handoff,
        timing: RequestTiming | None = None,
        layer_hook: LayerHook | None = None,
    ) -> Prefilled:
        request_id, prompt_ids, params = request.request_id, request.prompt_ids, request.params
        if handoff is Handoff.HOLD or layer_hook is not None:
            raise InvalidArgumentError("transport", NO_BLOCK_ACCESS)
        context_only = (
            self._api.DisaggregatedParams(request_type="context_only")
            if handoff is Handoff.NATIVE
            else None
        )
        kept: list[Any] = []  # TensorRT-LLM's finished output: its disaggregated params
        stream = self._requests.stream(
            request_id,
            prompt_ids,
            params.first_token_only(),
            lambda: self._llm.generate_async(
                list(prompt_ids),
                sampling_params=self._sampling(params.first_token_only(), len(prompt_ids)),
                streaming=False,
                disaggregated_params=context_only,
            ),
            reservation_id=request.reservation_id,
            timing=timing,
            on_finish=kept.append,
        )
        last: RequestOutput | None = None
        async with contextlib.aclosing(stream):
            async for output in stream:
                last = output
        if last is None or not kept:
            raise WorkerUnavailableError(f"tensorrt-llm ended {request_id!r} without output")
        if handoff is not Handoff.NATIVE or last.finish_reason is FinishReason.STOP:
            return Prefilled(last)  # a stop token ends the request: nothing to hand over
        disaggregated = kept[-1].outputs[0].disaggregated_params
        if disaggregated is None:
            raise KVTransferError(f"tensorrt-llm kept no KV for context-only {request_id!r}")
        return Prefilled(last, native_of(disaggregated))

    def decode(
        self,
        request: EngineRequest,
        first_token: tuple[int, float],
        kv: KVPayload | NativeKV | None,
        *,
        timing: RequestTiming | None = None,
        coalesce: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        request_id, prompt_ids, params = request.request_id, request.prompt_ids, request.params
        reservation_id = request.reservation_id
        if isinstance(kv, NativeKV):
            return self._decode_native(request_id, prompt_ids, params, kv, reservation_id, timing)
        if kv is not None:
            return refuse(InvalidArgumentError("kv.location", NO_BLOCK_ACCESS))
        # Recompute: the prompt and the prefill's first token as one request.
        tokens = [*prompt_ids, first_token[0]]
        return self._continue(request_id, tokens, params, 1, reservation_id, timing)

    def _decode_native(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        kv: NativeKV,
        reservation_id: str,
        timing: RequestTiming | None,
    ) -> AsyncGenerator[RequestOutput, None]:
        if kv.backend != self.name:
            return refuse(
                InvalidArgumentError(
                    "kv.native.backend", f"{kv.backend!r} wrote this KV; this worker is {self.name}"
                )
            )
        return self._requests.stream(
            request_id,
            prompt_ids,
            params,
            lambda: self._llm.generate_async(
                list(prompt_ids),
                sampling_params=self._sampling(params, len(prompt_ids)),
                streaming=True,
                disaggregated_params=generation_params(self._api, kv),
            ),
            reservation_id=reservation_id,
            timing=timing,
            skip=len(kv.first_gen_tokens),
        )

    def _sampling(self, params: SamplingParams, prompt_len: int) -> Any:
        return sampling_params(self._api, params, prompt_len=prompt_len, vocab_size=self.vocab_size)

    async def export_kv(self, request_id: str) -> KVPayload:
        raise InvalidArgumentError("kv.location", NO_BLOCK_ACCESS)

    def abort(self, request_id: str) -> None:
        self._requests.abort(request_id)

    def hand_back(self, why: str) -> None:
        self._requests.hand_back(why)

    async def cached_prefix_blocks(self, block_hashes: Sequence[bytes]) -> int:
        return 0  # TensorRT-LLM's block reuse is its own: it cannot be exported

    async def export_cached_prefix(self, block_hashes: Sequence[bytes]) -> KVPayload | None:
        return None

    def capacity(self) -> Capacity:
        kv = self._kv
        load = self._requests.load()
        return Capacity(
            blocks_total=kv.blocks_total,
            blocks_free=kv.blocks_free,
            block_size=kv.block_size or self.layout.block_size,
            queued_tokens=load.queued_tokens,
            running=load.running,
            waiting=load.waiting,
            tags=load.tags,
            failed_requests=load.failed,
            failed=self._fatal is not None,
        )
