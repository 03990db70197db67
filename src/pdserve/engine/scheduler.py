"""Continuous batching under a per-step token budget. Policy only: no tensors here.

Each step:
  1. Running sequences first, oldest first: one token for those decoding, the next chunk for
     those still prefilling. When the pool runs dry, the newest running sequence is preempted
     (its blocks freed, recomputed later) until the older one fits.
  2. Then waiting sequences, while the budget, ``max_num_seqs`` and free blocks allow: in
     arrival order (``waiting_order="fcfs"``), or fewest tokens to compute first, aged by the
     wait (``short_first``); leading blocks come from the prefix cache, the rest is computed,
     chunked if the prompt is longer than the remaining budget.
  3. ``update`` applies what the step computed: advances ``num_computed_tokens``, publishes
     full blocks to the prefix cache, appends sampled tokens and finishes sequences whose
     token-level stop conditions hit (stop strings are the engine's: they need text).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute ``num_tokens`` tokens of ``seq`` from ``seq.num_computed_tokens`` on."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so its logits give the next token."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    decodes: tuple[ScheduledChunk, ...]
    """One token each, batched through block tables."""
    prefills: tuple[ScheduledChunk, ...]
    """Prompt chunks (or a recompute after preemption)."""
    preempted: tuple[Sequence, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Decides what each engine step computes; owns the waiting/running queues."""

    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, *, max_model_len: int
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.enqueued_at = time.monotonic()
        self.waiting.append(seq)

    def _next_waiting(self) -> Sequence:
        """The waiting sequence to admit next (see ``EngineConfig.waiting_order``)."""
        if self.config.waiting_order == "fcfs" or len(self.waiting) == 1:
            return self.waiting[0]
        now, aging = time.monotonic(), self.config.aging_tokens_per_s
        return min(
            self.waiting,
            key=lambda s: s.num_pending_tokens - aging * (now - s.enqueued_at),
        )

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose KV is already in its blocks (an imported hand-off)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- 1-2: schedule -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        bm, cfg = self.block_manager, self.config
        budget = cfg.max_num_batched_tokens
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending_tokens, budget)
            if n < seq.num_pending_tokens and not cfg.enable_chunked_prefill:
                i += 1
                continue
            while not bm.allocate(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                chunk = ScheduledChunk(seq, n)
                generating = seq.num_computed_tokens >= seq.num_prompt_tokens
                (decodes if generating and n == 1 else prefills).append(chunk)
                budget -= n
                i += 1

        while (
            self.waiting and budget > 0 and not preempted and len(self.running) < cfg.max_num_seqs
        ):
            seq = self._next_waiting()
            # A prompt whose logprobs are asked for needs the logits of every position.
            bm.take_prefix(seq, [] if seq.wants_prompt_logprobs else bm.match_prefix(seq))
            pending = seq.num_pending_tokens
            n = min(pending, budget)
            if n < pending and not cfg.enable_chunked_prefill:
                if decodes or prefills:
                    bm.free(seq)
                    break
                n = pending  # a lone long prompt runs whole rather than starve
            if not bm.allocate(seq, seq.num_computed_tokens + n):
                bm.free(seq)
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            prefills.append(ScheduledChunk(seq, n))
            budget -= n
        return SchedulerOutput(tuple(decodes), tuple(prefills), tuple(preempted))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # -- 3: update -----------------------------------------------------------------------
    def update(
        self, output: SchedulerOutput, sampled: dict[str, tuple[int, float]]
    ) -> list[Sequence]:
        """Apply a step's results. ``sampled``: request id -> (token, logprob).

        Returns the sequences that received a token this step, finished or not.
        """
        touched: list[Sequence] = []
        for chunk in (*output.decodes, *output.prefills):
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.register_computed_blocks(seq)
            if seq.request_id not in sampled:
                continue
            token, logprob = sampled[seq.request_id]
            seq.token_ids.append(token)
            seq.output_logprobs.append(logprob)
            touched.append(seq)
            status = self.token_stop(seq, token)
            if status is not None:
                self.finish(seq, status)
        return touched

    def token_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
        p = seq.params
        if token in p.stop_token_set:
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take ``seq`` out of the queues; free its blocks unless it holds them for export."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = status
        if not seq.hold_kv or status == SequenceStatus.FINISHED_ABORTED:
            self.block_manager.free(seq)
