"""The engine: one step is schedule -> execute -> update.

Request lifecycle (see ``sequence.py`` for states):
  1. ``add_request`` validates and tokenizes (``intake.py``), then queues (or, with ``kv=``,
     imports a hand-off).
  2. ``step`` schedules a batch under the token budget, runs it, appends sampled tokens and
     returns one ``RequestOutput`` per request that received a token.
  3. A finished request's blocks are freed at once, unless it was added with ``hold_kv``:
     then ``export_kv`` reads them and ``release_kv`` frees them. ``abort`` frees at once.

A step that fails fails only its own requests: ``step`` aborts them and raises
``StepFailedError`` with the outputs of the rest (a row of the batch whose logits are not
finite fails alone; a forward pass that raises fails the whole batch; an imported KV that
cannot be written fails its request). Any other exception from ``step`` means the engine's
bookkeeping cannot be trusted any more.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.faults import EngineFaults
from pdserve.engine.gate import UNGATED, ComputeGate
from pdserve.engine.guided import Guides
from pdserve.engine.intake import Intake, LiveRequest
from pdserve.engine.kv_arrays import contiguous
from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.engine.outputs import (
    EngineStats,
    GenerationResult,
    RequestOutput,
    StepFailedError,
    StepShape,
)
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import LayerHook, Sequence, SequenceStatus
from pdserve.engine.step_runner import ComputeFactory, StepRunner, torch_compute
from pdserve.errors import (
    DuplicateRequestError,
    InvalidArgumentError,
    RequestFailedError,
    UnknownRequestError,
)
from pdserve.models.config import ModelConfig
from pdserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch


class Engine:
    """A paged-KV, continuously batching engine for one model on one device."""

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        faults: EngineFaults | None = None,
        compute: ComputeFactory | None = None,
    ) -> None:
        """``faults``: failures to inject on purpose, for fault tests only. ``compute``: what
        runs the steps (default: the checkpoint's model, ``torch_compute``)."""
        self.config = config = config or EngineConfig()
        self.model_dir = Path(model_dir)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        mc = self.model_config
        # Within a sliding window, full attention is exact; past it we would diverge, so cap there.
        limit = min(mc.max_position_embeddings, mc.sliding_window or mc.max_position_embeddings)
        self.max_model_len = min(config.max_model_len or limit, limit)
        built = (compute or torch_compute(faults))(self.model_dir, mc, config, self.max_model_len)
        self.dtype: torch.dtype | None = built.dtype
        """The torch KV (and compute) dtype; None for a runner without torch (the sim)."""
        self.layout: KVLayout = built.layout
        self.runner: StepRunner = built.runner
        self.block_manager = BlockManager(
            built.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager, max_model_len=self.max_model_len)
        self.guides = Guides(self.tokenizer, mc.vocab_size, cache_bytes=config.guide_cache_bytes)
        """Compiles structured-output guides (thread-safe: compile ahead off this thread)."""
        self.gate: ComputeGate = UNGATED
        """Brackets each step's compute (sharing the device with other engines); set it
        before the first step."""
        self.intake = Intake(
            self.tokenizer, mc.vocab_size, self.max_model_len, config.block_size,
            built.num_blocks, self.layout, self.guides, self.scheduler.token_stop,
        )  # fmt: skip
        """Checks added requests and makes them sequences."""
        self._requests: dict[str, LiveRequest] = {}
        self._held: dict[str, Sequence] = {}
        self._imports: deque[tuple[Sequence, KVPayload]] = deque()
        self.last_step = StepShape()
        """The shape of the latest ``step`` (for step-time models)."""

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        faults: EngineFaults | None = None,
        compute: ComputeFactory | None = None,
        **config: Any,
    ) -> Engine:
        """Load a checkpoint directory; keyword arguments are ``EngineConfig`` fields."""
        return cls(path, EngineConfig(**config), faults=faults, compute=compute)

    # -- requests ------------------------------------------------------------------------
    def add(
        self,
        request: EngineRequest,
        *,
        hold_kv: bool = False,
        layer_hook: LayerHook | None = None,
        kv: KVPayload | None = None,
        first_token: tuple[int, float] | None = None,
        generated: Seq[int] = (),
    ) -> list[int]:
        """Queue ``request`` as the serving stack hands it down (see ``add_request``)."""
        return self.add_request(
            request.request_id, request.prompt_ids, request.params, hold_kv=hold_kv,
            layer_hook=layer_hook, tenant=request.tenant, kv=kv, first_token=first_token,
            generated=generated,
        )  # fmt: skip

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        hold_kv: bool = False,
        layer_hook: LayerHook | None = None,
        tenant: str = "",
        kv: KVPayload | None = None,
        first_token: tuple[int, float] | None = None,
        generated: Seq[int] = (),
    ) -> list[int]:
        """Queue a request; returns its prompt token ids.

        ``hold_kv``: keep the KV after the request finishes, for ``export_kv``.
        ``layer_hook``: called per layer as the prompt's KV completes (for streaming hand-off).
        ``tenant``: the prefix-cache namespace: equal prompts of different tenants share no
        blocks. ``kv`` + ``first_token``: continue a request prefilled elsewhere.
        ``generated``: output tokens another engine produced before it went away (a migrated
        request; not with ``kv``): the prompt and these are prefilled as a preempted
        sequence is, and the request continues at output position ``len(generated)``, so
        ``max_tokens``, stop conditions and seeded draws run on as if it had never moved.
        """
        if request_id in self._requests or request_id in self._held:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        req = self.intake.request(
            request_id, prompt, params or SamplingParams(), hold_kv=hold_kv,
            layer_hook=layer_hook, tenant=tenant, kv=kv, first_token=first_token,
            generated=generated,
        )  # fmt: skip
        if kv is None:
            self.scheduler.add(req.seq)
        else:
            self._imports.append((req.seq, kv))
        self._requests[request_id] = req
        return req.seq.token_ids[: req.seq.num_prompt_tokens]

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks now. False if it is not (or no longer) here."""
        if request_id in self._held:
            self.release_kv(request_id)
            return True
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        pending = next((item for item in self._imports if item[0] is req.seq), None)
        if pending is not None:
            self._imports.remove(pending)
        elif not req.seq.status.finished:
            self.scheduler.finish(req.seq, SequenceStatus.FINISHED_ABORTED)
        return True

    # -- hand-off ------------------------------------------------------------------------
    def export_kv(self, request_id: str) -> KVPayload:
        """Copy the prompt KV of a finished ``hold_kv`` request (blocks stay held)."""
        seq = self._held.get(request_id)
        if seq is None:
            raise UnknownRequestError(f"no held KV for request {request_id!r}")
        return self._read_payload(seq.block_table, seq.num_prompt_tokens)

    def release_kv(self, request_id: str) -> None:
        """Free the blocks a finished ``hold_kv`` request kept."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            raise UnknownRequestError(f"no held KV for request {request_id!r}")
        self.block_manager.free(seq)

    def cached_prefix_blocks(self, block_hashes: Seq[bytes]) -> int:
        """How many of ``block_hashes`` (``chain_block_hashes`` of a prompt, with its cache
        salt and this engine's block size), from the first on, the prefix cache holds now.

        A hint for a peer deciding what to send: the blocks may be evicted right after.
        """
        found = 0
        for h in block_hashes:
            if self.block_manager.cached_block(h) is None:
                break
            found += 1
        return found

    def export_cached_prefix(self, block_hashes: Seq[bytes]) -> KVPayload | None:
        """A copy of the KV of the cached blocks ``block_hashes`` (all of them, in order),
        ``[len(block_hashes) * block_size, kvh, hd]`` per layer; None if one was evicted."""
        ids = [self.block_manager.cached_block(h) for h in block_hashes]
        if not ids or any(i is None for i in ids):
            return None
        table = [i for i in ids if i is not None]
        return self._read_payload(table, len(table) * self.config.block_size)

    def _read_payload(self, block_table: list[int], n: int) -> KVPayload:
        """A CPU copy of the first ``n`` tokens' KV in ``block_table``, every layer."""
        # The layout's layers: those of the KV the runner keeps (a sim runner's stand-in
        # has the modelled model's, not the checkpoint's).
        layers = [self.runner.read_layer(i, block_table, n) for i in range(self.layout.num_layers)]
        return KVPayload(
            self.layout,
            n,
            tuple(contiguous(k) for k, _ in layers),
            tuple(contiguous(v) for _, v in layers),
        )

    def _admit_imports(self, failures: dict[str, RequestFailedError]) -> list[RequestOutput]:
        """Admit waiting hand-offs while there is room; one whose KV cannot be written fails
        alone (into ``failures``)."""
        outputs: list[RequestOutput] = []
        while self._imports and len(self.scheduler.running) < self.config.max_num_seqs:
            seq, kv = self._imports[0]
            if not self.block_manager.allocate(seq, kv.num_tokens + 1):
                break
            self._imports.popleft()
            try:
                for i in range(kv.layout.num_layers):
                    self.runner.write_layer(i, seq.block_table, kv.keys[i], kv.values[i])
            except Exception as err:  # a payload whose tensors do not fit its layout
                self.block_manager.free(seq)
                seq.status = SequenceStatus.FINISHED_ABORTED
                del self._requests[seq.request_id]
                failures[seq.request_id] = RequestFailedError(f"cannot import the KV: {err!r}")
                continue
            finally:
                if kv.release is not None:  # the transport's memory is free for its next one
                    kv.release()
            seq.num_computed_tokens = seq.num_cached_tokens = kv.num_tokens
            self.block_manager.register_computed_blocks(seq)
            self.scheduler.add_running(seq)
            status = self.scheduler.token_stop(seq, seq.token_ids[-1])
            if status is None and self._requests[seq.request_id].text.stopped:
                status = SequenceStatus.FINISHED_STOPPED
            if status is not None:  # the first token already ends it (max_tokens=1, EOS)
                self.scheduler.finish(seq, status)
                outputs.append(self._output(self._requests[seq.request_id], [], []))
        return outputs

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule -> execute -> update. Returns deltas of requests that progressed.

        Raises ``StepFailedError`` when requests failed (see the module docstring).
        """
        failures: dict[str, RequestFailedError] = {}
        outputs = self._admit_imports(failures)
        sched = self.scheduler.schedule()
        prefill_tokens = sched.num_tokens - len(sched.decodes)
        self.last_step = StepShape(prefill_tokens, len(sched.decodes))
        if sched.is_empty:
            return self._finish_step(outputs, failures)
        try:
            with self.gate.hold(prefill_tokens, len(sched.decodes)):
                result = self.runner.execute(
                    sched, self.gate.checkpoint if prefill_tokens else None
                )
        except Exception as err:  # nothing of the step was applied: fail its requests
            why = RequestFailedError(f"the engine step failed: {err!r}")
            for chunk in (*sched.decodes, *sched.prefills):
                self.abort(chunk.seq.request_id)
                failures[chunk.seq.request_id] = why
            return self._finish_step(outputs, failures)
        for rid, piece in result.prompt.items():
            prompt = self._requests[rid].seq.prompt_logprobs
            if prompt is not None:
                prompt.extend(piece.logprobs, piece.ranks, piece.top)
        for seq in self.scheduler.update(sched, result.sampled):
            req = self._requests[seq.request_id]
            token, logprob = seq.token_ids[-1], seq.output_logprobs[-1]
            ended = seq.guide is not None and seq.guide.advance(token)  # the grammar is done
            if (req.text.add(token) or ended) and not seq.status.finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)  # or a stop string
            out = self._output(req, [token], [logprob])
            top = result.top.get(seq.request_id)
            out.new_top_logprobs = [top] if top is not None else []
            if seq.num_output_tokens == 1:
                out.prompt_logprobs = seq.prompt_logprobs
            if result.logits is not None:
                out.logits = result.logits[seq.request_id]
            outputs.append(out)
        for rid, reason in result.failed.items():  # after update: its computed KV is valid
            self.abort(rid)
            failures[rid] = RequestFailedError(reason)
        return self._finish_step(outputs, failures)

    @staticmethod
    def _finish_step(
        outputs: list[RequestOutput], failures: dict[str, RequestFailedError]
    ) -> list[RequestOutput]:
        if failures:
            raise StepFailedError(failures, outputs)
        return outputs

    def _output(self, req: LiveRequest, tokens: list[int], logprobs: list[float]) -> RequestOutput:
        seq = req.seq
        finished = seq.status.finished
        out = RequestOutput(
            seq.request_id,
            tokens,
            logprobs,
            text=req.text.take(final=finished),
            finished=finished,
            finish_reason=seq.status.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )
        if finished:
            del self._requests[seq.request_id]
            if seq.hold_kv:
                self._held[seq.request_id] = seq
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._imports)

    def generate(
        self,
        prompts: str | Seq[int] | Iterable[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run prompts to completion (simple use; services drive ``step`` themselves)."""
        prompt_list = _as_prompt_list(prompts)
        param_list = (
            list(params)
            if isinstance(params, Seq)
            else [params or SamplingParams()] * len(prompt_list)
        )
        if len(param_list) != len(prompt_list):
            raise InvalidArgumentError(
                "params", "need one SamplingParams per prompt, or a single one"
            )
        results: dict[str, GenerationResult] = {}
        ids = [f"gen-{self.intake.arrivals + i}-{id(self)}" for i in range(len(prompt_list))]
        for rid, prompt, p in zip(ids, prompt_list, param_list, strict=True):
            tokens = self.add_request(rid, prompt, p)
            results[rid] = GenerationResult(rid, tokens, [], [], "", None)  # type: ignore[arg-type]
        while self.has_unfinished():
            for out in self.step():
                r = results[out.request_id]
                r.token_ids += out.new_token_ids
                r.logprobs += out.new_logprobs
                r.top_logprobs += out.new_top_logprobs
                r.prompt_logprobs = r.prompt_logprobs or out.prompt_logprobs
                r.text += out.text
                if out.finished:
                    assert out.finish_reason is not None
                    r.finish_reason = out.finish_reason
                    r.num_cached_tokens = out.num_cached_tokens
        return [results[rid] for rid in ids]

    # -- introspection -------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        queued = sum(q.num_pending_tokens for q in s.waiting) + sum(
            q.num_pending_tokens for q in s.running if q.num_computed_tokens < q.num_prompt_tokens
        )
        return EngineStats(
            num_blocks_total=bm.num_blocks,
            num_blocks_free=bm.num_free_blocks,
            block_size=bm.block_size,
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(self._imports),
            num_waiting_imports=len(self._imports),
            num_held=len(self._held),
            queued_tokens=queued,
            num_preemptions=s.num_preemptions,
            prefix_cache_hits=bm.prefix_hits,
        )

    def check_no_leaks(self) -> None:
        """Raise unless the engine is idle with every block free and ref counts consistent."""
        if self.has_unfinished() or self._requests or self._held:
            raise RuntimeError(
                f"engine not idle: {len(self._requests)} requests, {len(self._held)} held, "
                f"{len(self.scheduler.running)} running, {len(self.scheduler.waiting)} waiting"
            )
        self.block_manager.check_consistency([])
        if self.block_manager.num_free_blocks != self.block_manager.num_blocks:
            raise RuntimeError("KV blocks leaked")


def _as_prompt_list(prompts: str | Seq[int] | Iterable[str | Seq[int]]) -> list[str | Seq[int]]:
    """One prompt (text or token ids) or many, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]
    return items  # type: ignore[return-value]
