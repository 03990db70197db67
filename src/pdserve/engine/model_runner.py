"""Executes a scheduled step: builds the flat batch, runs the model, samples. No policy here."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.faults import EngineFaults
from pdserve.engine.kv_tensors import as_tensor
from pdserve.engine.logprobs import PromptRows
from pdserve.engine.outputs import StepResult
from pdserve.engine.sampler import sample
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.models import cpu_attention
from pdserve.models.attention_metadata import (
    AttentionMetadata,
    DecodeGroup,
    DecodeTables,
    PrefillSpan,
)
from pdserve.models.config import ModelConfig
from pdserve.models.linear import can_prepack
from pdserve.models.llama import KVCache, LlamaModel

if TYPE_CHECKING:
    from pdserve.engine.kv_arrays import KVArray

GROUP_OVERHEAD_TOKENS = 256
"""A decode group's fixed cost (its gather and attention calls, per layer) in padded key
positions' worth; padding below this is cheaper than another group."""


def length_groups(lengths: Seq[int]) -> list[tuple[int, int]]:
    """Split ascending context ``lengths`` into ``(start, end)`` runs to pad to one length each.

    A run grows while its padding (``count * longest - sum``) stays under
    ``GROUP_OVERHEAD_TOKENS`` or under half the keys it really reads: a step whose decodes
    are all alike is one group, and one 2K-token context among short ones is its own, so the
    short ones do not each read 2K padded keys.
    """
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(lengths):
        if i > start:
            if n < lengths[i - 1]:
                raise ValueError("lengths must be ascending")
            padding = (i - start + 1) * n - (total + n)
            if padding > max(GROUP_OVERHEAD_TOKENS, (total + n) // 2):
                groups.append((start, i))
                start, total = i, 0
        total += n
    if lengths:
        groups.append((start, len(lengths)))
    return groups


class ModelRunner:
    """Owns the model weights and the paged KV pool on one device."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        num_blocks: int,
        max_model_len: int,
        faults: EngineFaults | None = None,
    ) -> None:
        self.cfg = model_config
        self.faults = faults
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.block_size = config.block_size
        # Build on the meta device (no random init of weights we overwrite anyway), then
        # materialise on the target device and copy the checkpoint in.
        with torch.device("meta"):
            model = LlamaModel(model_config, max_model_len)
        model = model.to_empty(device=self.device).to(dtype)
        model.load_hf_weights(weights)
        model.init_rope()  # the tables were built on the meta device with the modules
        if config.prepack_weights and can_prepack(self.device, dtype):
            model.prepack()
        self.model = model.eval()
        self.native = (
            cpu_attention.kernels_for(
                self.device,
                dtype,
                model_config.num_heads,
                model_config.num_kv_heads,
                model_config.head_dim,
            )
            if config.attention_kernels
            else cpu_attention.NONE
        )
        """Which attention passes run on the native CPU kernels (the rest on torch's SDPA)."""
        shape = (num_blocks, self.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_cache: KVCache = [
            (
                torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device),
            )
            for _ in range(model_config.num_layers)
        ]
        self._arange = torch.arange(max_model_len + self.block_size, device=self.device)

    # -- step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, checkpoint: Callable[[], None] | None = None
    ) -> StepResult:
        """Run one scheduled step; ``checkpoint()`` is called between layers (see
        ``engine.gate``)."""
        if self.faults is not None and self.faults.fails_step(
            c.seq for c in (*out.decodes, *out.prefills)
        ):
            raise RuntimeError("injected fault: this step fails")
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        ctx_lens: list[int] = []
        # Decodes ordered by context length, so that length groups are runs of rows.
        decodes = sorted(out.decodes, key=lambda c: c.seq.num_computed_tokens)
        for chunk in decodes:
            seq = chunk.seq
            p = seq.num_computed_tokens
            sample_rows.append(len(ids))
            sample_seqs.append(seq)
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            ctx_lens.append(p + 1)
        spans: list[PrefillSpan] = []
        hooked: list[tuple[Sequence, int]] = []
        prompt_rows = PromptRows()
        for chunk in out.prefills:
            seq, n = chunk.seq, chunk.num_tokens
            p0, start = seq.num_computed_tokens, len(ids)
            prompt_rows.add(seq, start, n)
            ids.extend(seq.token_ids[p0 : p0 + n])
            pos.extend(range(p0, p0 + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(p0, p0 + n))
            ctx = p0 + n
            if p0 == 0:
                spans.append(PrefillSpan(start, n, ctx, None, None))
            elif self.native.prefill:  # the kernel masks by position itself
                spans.append(PrefillSpan(start, n, ctx, self._long(table[: -(-ctx // bs)]), None))
            else:
                ar = self._arange
                mask = ar[:ctx].unsqueeze(0) <= ar[p0:ctx].unsqueeze(1)  # [n, ctx] causal, offset
                spans.append(PrefillSpan(start, n, ctx, self._long(table[: -(-ctx // bs)]), mask))
            if chunk.samples:
                sample_rows.append(start + n - 1)
                sample_seqs.append(seq)
                if seq.layer_hook is not None:
                    hooked.append((seq, ctx))

        T, D = len(ids), len(out.decodes)
        if self.native.decode:
            # One host->device copy for the per-token vectors (ids, positions, slots) and the
            # decode kernel's context lengths, table offsets and block tables (concatenated).
            starts: list[int] = []
            tables: list[int] = []
            for chunk, c in zip(decodes, ctx_lens, strict=True):
                starts.append(len(tables))
                tables.extend(chunk.seq.block_table[: -(-c // bs)])
            flat = self._long(ids + pos + slots + ctx_lens + starts + tables)
            lens_at, starts_at = 3 * T, 3 * T + D
            meta = AttentionMetadata(
                slot_mapping=flat[2 * T : 3 * T],
                num_decodes=D,
                decode_groups=[],
                prefills=spans,
                decode_tables=DecodeTables(
                    flat[starts_at + D :], flat[starts_at : starts_at + D], flat[lens_at:starts_at]
                ),
                native_prefill=self.native.prefill,
            )
        else:
            # One host->device copy for the per-token vectors: ids, positions, slots.
            flat = self._long(ids + pos + slots)
            meta = AttentionMetadata(
                slot_mapping=flat[2 * T :],
                num_decodes=D,
                decode_groups=[
                    self._decode_group(decodes[a:b], ctx_lens[a:b], a)
                    for a, b in length_groups(ctx_lens)
                ],
                prefills=spans,
                native_prefill=self.native.prefill,
            )

        # Logits rows: every row when the step is decode only (no gather needed); after the
        # sampled rows, those whose logits give prompt logprobs.
        S = len(sample_rows)
        every = S == T and not prompt_rows.positions
        rows = None if every else self._long(sample_rows + prompt_rows.positions)
        logits = self.model(
            flat[:T],
            flat[T : 2 * T],
            self.kv_cache,
            meta,
            rows,
            after_layer=self._layer_hook_caller(hooked) if hooked else None,
            checkpoint=checkpoint,
        )
        prompt = prompt_rows.split(logits[S:]) if prompt_rows.positions else {}
        if not sample_seqs:  # only non-final prompt chunks this step
            return StepResult({}, prompt=prompt)
        logits = logits[:S]
        if self.faults is not None:
            for i, s in enumerate(sample_seqs):
                if self.faults.nan_logits(s):
                    logits[i] = float("nan")
        samples = sample(logits, sample_seqs)
        result = StepResult(
            {
                s.request_id: (t, lp)
                for i, (s, t, lp) in enumerate(
                    zip(sample_seqs, samples.tokens, samples.logprobs, strict=True)
                )
                if i not in samples.failed
            },
            {sample_seqs[i].request_id: why for i, why in samples.failed.items()},
            top={sample_seqs[i].request_id: top for i, top in samples.top.items()},
            prompt=prompt,
        )
        if self.config.return_logits:
            result.logits = {s.request_id: logits[i].cpu() for i, s in enumerate(sample_seqs)}
        return result

    def _decode_group(
        self, chunks: Seq[ScheduledChunk], ctx_lens: list[int], start: int
    ) -> DecodeGroup:
        bs = self.block_size
        S = ctx_lens[-1]  # ascending: the last is the longest
        width = -(-S // bs)  # blocks of the longest context
        block_ids: list[int] = []
        for chunk in chunks:
            row = chunk.seq.block_table[:width]
            block_ids.extend(row)
            block_ids.extend([0] * (width - len(row)))
        mask = None
        if ctx_lens[0] != S:  # padding to mask out: [n, 1, 1, S]
            valid = self._arange[:S] < self._long(ctx_lens).unsqueeze(1)
            mask = torch.zeros(valid.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~valid, float("-inf")
            )[:, None, None, :]
        return DecodeGroup(start, len(chunks), self._long(block_ids), S, mask)

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _layer_hook_caller(self, hooked: list[tuple[Sequence, int]]) -> Callable[[int], None]:
        def after_layer(layer: int) -> None:
            for seq, ctx in hooked:
                assert seq.layer_hook is not None
                k, v = self.read_layer(layer, seq.block_table, ctx)
                seq.layer_hook(layer, k, v)

        return after_layer

    # -- KV import / export ------------------------------------------------------------------
    def read_layer(
        self, layer: int, block_table: list[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K, V of a sequence, ``[num_tokens, kvh, hd]`` each (gathered copies)."""
        table = self._long(block_table[: -(-num_tokens // self.block_size)])
        k_cache, v_cache = self.kv_cache[layer]
        kvh, hd = self.cfg.num_kv_heads, self.cfg.head_dim
        return (
            k_cache.index_select(0, table).view(-1, kvh, hd)[:num_tokens],
            v_cache.index_select(0, table).view(-1, kvh, hd)[:num_tokens],
        )

    def write_layer(
        self, layer: int, block_table: list[int], keys: KVArray, values: KVArray
    ) -> None:
        """Copy ``[num_tokens, kvh, hd]`` K/V into the slots of ``block_table``; received
        numpy arrays (``kv_arrays``) are viewed as this engine's dtype first, without a copy."""
        keys, values = as_tensor(keys, self.dtype), as_tensor(values, self.dtype)
        n = keys.shape[0]
        bs = self.block_size
        table = self._long(block_table)
        pos = self._arange[:n]
        slots = table[pos // bs] * bs + pos % bs
        k_cache, v_cache = self.kv_cache[layer]
        kvh, hd = self.cfg.num_kv_heads, self.cfg.head_dim
        k_cache.view(-1, kvh, hd).index_copy_(0, slots, keys.to(self.device, self.dtype))
        v_cache.view(-1, kvh, hd).index_copy_(0, slots, values.to(self.device, self.dtype))
