"""``LLM`` of the stand-in: TensorRT-LLM's request semantics on pdserve's own engine.

* ``generate_async`` needs a running event loop and returns a ``RequestOutput`` at once; the
  request runs on pdserve's ``AsyncEngine``. Iterating the output (``streaming=True``) updates
  it in place, cumulatively, once per engine step; without streaming it yields once, finished.
  ``aresult()`` waits for the end; ``abort()`` cancels (finish reason ``cancelled``).
* ``context_only`` needs a ``cache_transceiver_config``: the prompt runs to its first token,
  its KV is written to a file in ``$FAKE_TENSORRT_LLM_KV_DIR`` (the transceiver's stand-in) and
  the output's ``disaggregated_params`` say where (``opaque_state``), with the first token and
  the context request's id. A first token that ends the request (a stop token) keeps nothing.
* ``generation_only`` reads that file back (and deletes it), imports the KV and continues; its
  token ids are cumulative from the context phase's first token, whose logprob it does not
  repeat. A file that is not there ends the request with finish reason ``timeout``.
* ``get_stats_async`` yields the latest iteration's statistics when iterations ran since the
  previous call, only with ``enable_iter_perf_stats``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.engine.engine import Engine
from pdserve.engine.guide import Guide
from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.outputs import FinishReason
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams as PdSamplingParams
from pdserve.engine_loop.async_engine import AsyncEngine
from tensorrt_llm._fake_params import (
    REQUEST_TYPES,
    CacheTransceiverConfig,
    DisaggregatedParams,
    GuidedDecodingParams,
    KvCacheConfig,
    SamplingParams,
)

KV_DIR_ENV = "FAKE_TENSORRT_LLM_KV_DIR"
_FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "cancelled",
}
_ids = itertools.count(1)


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    disaggregated_params: DisaggregatedParams | None = None


@dataclass(frozen=True, slots=True)
class _Update:
    token_ids: list[int]
    logprobs: list[Any]
    text: str
    finish_reason: str | None
    disaggregated_params: DisaggregatedParams | None = None


class RequestOutput:
    """One request's output, updated in place as it is iterated."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], streaming: bool) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [CompletionOutput(index=0)]
        self.finished = False
        self.cached_tokens = 0
        self._streaming = streaming
        self._updates: asyncio.Queue[_Update | BaseException] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while True:
            self._apply(await self._updates.get())
            if self._streaming or self.finished:
                return self

    async def aresult(self) -> RequestOutput:
        while not self.finished:
            self._apply(await self._updates.get())
        return self

    def abort(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _apply(self, update: _Update | BaseException) -> None:
        if isinstance(update, BaseException):
            self.finished = True
            raise update
        out = self.outputs[0]
        out.token_ids = list(update.token_ids)
        out.logprobs = list(update.logprobs)
        out.text = update.text
        out.finish_reason = update.finish_reason
        out.disaggregated_params = update.disaggregated_params
        self.finished = update.finish_reason is not None


class LLM:
    """A model on pdserve's engine behind TensorRT-LLM's ``LLM`` interface."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "auto",
        max_seq_len: int | None = None,
        max_num_tokens: int | None = None,
        max_batch_size: int | None = None,
        kv_cache_config: KvCacheConfig | None = None,
        cache_transceiver_config: CacheTransceiverConfig | None = None,
        enable_iter_perf_stats: bool = False,
        guided_decoding_backend: str | None = None,
    ) -> None:
        if dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"the stand-in computes in float32 or bfloat16, not {dtype!r}")
        kv = kv_cache_config or KvCacheConfig()
        config: dict[str, Any] = {
            "dtype": dtype,
            "block_size": kv.tokens_per_block,
            "num_kv_blocks": max(
                2, (kv.max_tokens or 256 * kv.tokens_per_block) // kv.tokens_per_block
            ),
            "max_model_len": max_seq_len,
        }
        if max_batch_size is not None:
            config["max_num_seqs"] = max_batch_size
        if max_num_tokens is not None:
            config["max_num_batched_tokens"] = max_num_tokens
        self.kv_cache_config = kv
        self.cache_transceiver_config = cache_transceiver_config
        self.enable_iter_perf_stats = enable_iter_perf_stats
        self.guided_decoding_backend = guided_decoding_backend
        self._engine = AsyncEngine(Engine.from_pretrained(model, **config))
        self._engine.start()
        self._steps_reported = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._kv_dir = Path(
            os.environ.get(KV_DIR_ENV) or Path(tempfile.gettempdir(), "fake-tensorrt-llm-kv")
        )

    def generate_async(
        self,
        inputs: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        streaming: bool = False,
        disaggregated_params: DisaggregatedParams | None = None,
    ) -> RequestOutput:
        loop = asyncio.get_running_loop()
        kind = "context_and_generation"
        if disaggregated_params is not None:
            kind = disaggregated_params.request_type or kind
            if kind not in REQUEST_TYPES:
                raise ValueError(f"Unknown request type: {kind}")
            if kind != "context_and_generation" and self.cache_transceiver_config is None:
                raise ValueError(f"{kind} requests need a cache_transceiver_config")
        request_id = (os.getpid() << 24) + next(_ids)  # unique across processes sharing the dir
        out = RequestOutput(request_id, [int(t) for t in inputs], streaming)
        sp = sampling_params or SamplingParams()
        if sp.guided_decoding is not None and self.guided_decoding_backend is None:
            raise ValueError("guided decoding needs an LLM built with guided_decoding_backend")
        task = loop.create_task(self._drive(out, sp, kind, disaggregated_params))
        out._task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return out

    async def get_stats_async(self, timeout: float | None = 2) -> AsyncIterator[dict[str, Any]]:
        snap = self._engine.snapshot()
        if not self.enable_iter_perf_stats or snap.num_steps == self._steps_reported:
            return
        self._steps_reported = snap.num_steps
        s = snap.stats
        yield {
            "iter": snap.num_steps,
            "numActiveRequests": s.num_running,
            "numQueuedRequests": s.num_waiting,
            "kvCacheStats": {
                "maxNumBlocks": s.num_blocks_total,
                "freeNumBlocks": s.num_blocks_free,
                "usedNumBlocks": s.num_blocks_total - s.num_blocks_free,
                "tokensPerBlock": s.block_size,
            },
        }

    def shutdown(self) -> None:
        """Stop the engine (call from a thread with no running event loop)."""
        asyncio.run(self._engine.close())

    # -- the requests ------------------------------------------------------------------------
    async def _drive(
        self, out: RequestOutput, sp: SamplingParams, kind: str, dp: DisaggregatedParams | None
    ) -> None:
        try:
            params = _pdserve_params(sp, len(out.prompt_token_ids))
            if kind == "context_only":
                await self._context(out, params)
            elif kind == "generation_only":
                assert dp is not None
                await self._generation(out, sp, params, dp)
            else:
                await self._run(out, sp, params)
        except asyncio.CancelledError:
            _push(out, _Update(out.outputs[0].token_ids, out.outputs[0].logprobs, "", "cancelled"))
            raise
        except Exception as err:  # delivered to whoever iterates the output
            _push(out, err)

    async def _run(
        self,
        out: RequestOutput,
        sp: SamplingParams,
        params: PdSamplingParams,
        *,
        kv: KVPayload | None = None,
        first: int | None = None,
    ) -> None:
        tokens = [first] if first is not None else []
        logprobs: list[Any] = []
        text = ""
        stream = self._engine.generate(
            EngineRequest(str(out.request_id), out.prompt_token_ids, params),
            kv=kv,
            first_token=(first, 0.0) if first is not None else None,
        )
        async with aclosing(stream):
            async for o in stream:
                tokens += o.new_token_ids
                if sp.logprobs is not None:
                    pairs = zip(o.new_token_ids, o.new_logprobs, strict=True)
                    logprobs += [{t: Logprob(lp, 1)} for t, lp in pairs]
                text += o.text
                reason = _FINISH[o.finish_reason] if o.finished and o.finish_reason else None
                _push(out, _Update(list(tokens), list(logprobs), text, reason))

    async def _context(self, out: RequestOutput, params: PdSamplingParams) -> None:
        rid = str(out.request_id)
        last = None
        stream = self._engine.generate(
            EngineRequest(rid, out.prompt_token_ids, params.first_token_only()), hold_kv=True
        )
        async with aclosing(stream):
            async for o in stream:
                last = o
        assert last is not None and last.new_token_ids
        token, logprob = last.new_token_ids[0], last.new_logprobs[0]
        logprobs = [{token: Logprob(logprob, 1)}]
        if last.finish_reason is FinishReason.STOP:  # the request ended: nothing to keep
            self._engine.abort(rid)
            _push(out, _Update([token], logprobs, last.text, "stop"))
            return
        payload = await self._engine.export_and_release(rid)
        path = self._kv_dir / f"{out.request_id}.kv"
        await asyncio.to_thread(_write, path, payload.to_bytes())
        dp = DisaggregatedParams(
            request_type="context_only",
            first_gen_tokens=[token],
            ctx_request_id=out.request_id,
            opaque_state=json.dumps({"path": str(path)}).encode(),
        )
        _push(out, _Update([token], logprobs, last.text, "length", dp))

    async def _generation(
        self,
        out: RequestOutput,
        sp: SamplingParams,
        params: PdSamplingParams,
        dp: DisaggregatedParams,
    ) -> None:
        if dp.ctx_request_id is None or not dp.first_gen_tokens or not dp.opaque_state:
            raise ValueError(
                "generation_only needs ctx_request_id, first_gen_tokens and opaque_state"
            )
        path = Path(json.loads(dp.opaque_state)["path"])
        try:
            blob = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:  # the context instance's KV is gone: the transfer times out
            _push(out, _Update([], [], "", "timeout"))
            return
        path.unlink(missing_ok=True)
        await self._run(
            out, sp, params, kv=KVPayload.from_bytes(blob), first=dp.first_gen_tokens[0]
        )


def _push(out: RequestOutput, update: _Update | BaseException) -> None:
    out._updates.put_nowait(update)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(path)


def _pdserve_params(sp: SamplingParams, prompt_len: int) -> PdSamplingParams:
    """pdserve's reading of TensorRT-LLM's sampling parameters (``top_k=1``, temperature 0,
    or nothing set at all: greedy). Presence and frequency penalties must ignore the whole
    prompt (``prompt_ignore_length``): pdserve's engine counts output tokens only."""
    unset = sp.temperature is None and sp.top_k is None and sp.top_p is None
    greedy = unset or sp.top_k == 1 or sp.temperature == 0
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    if (sp.presence_penalty or sp.frequency_penalty) and (
        sp.prompt_ignore_length or 0
    ) < prompt_len:
        raise NotImplementedError("the stand-in counts the penalties over output tokens only")
    if sp.bad is not None:
        raise NotImplementedError("the stand-in takes bad words as bad_token_ids only")
    bias = (
        {}
        if sp.embedding_bias is None
        else {int(t): float(sp.embedding_bias[t]) for t in sp.embedding_bias.nonzero().flatten()}
    )
    return PdSamplingParams(
        temperature=0.0 if greedy else (1.0 if sp.temperature is None else sp.temperature),
        top_k=0 if greedy else (sp.top_k or 0),
        top_p=1.0 if sp.top_p is None else sp.top_p,
        seed=sp.seed,
        max_tokens=sp.max_tokens,
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        stop=tuple(stop),
        ignore_eos=sp.ignore_eos,
        min_tokens=sp.min_tokens or 0,
        min_p=sp.min_p or 0.0,
        repetition_penalty=1.0 if sp.repetition_penalty is None else sp.repetition_penalty,
        presence_penalty=sp.presence_penalty or 0.0,
        frequency_penalty=sp.frequency_penalty or 0.0,
        bad_words_token_ids=tuple((t,) for t in sp.bad_token_ids or ()),
        logit_bias=bias,
        guide=_guide(sp.guided_decoding),
    )


def _guide(g: GuidedDecodingParams | None) -> Guide | None:
    """pdserve's guide of TensorRT-LLM's guided decoding parameters (its engine enforces it
    the way TensorRT-LLM's grammar backend does: the same library)."""
    if g is None:
        return None
    if g.structural_tag:
        raise NotImplementedError("the stand-in has no structural tags")
    if g.json is not None:
        return Guide.json_schema(g.json)
    if g.regex is not None:
        return Guide.regex(g.regex)
    if g.grammar is not None:
        return Guide.grammar(g.grammar)
    return Guide.json_object() if g.json_object else None
