"""What a step's attention needs to know besides q/k/v: which tokens of the flat batch are
decode tokens, which prefill chunks, and where their keys live in the paged cache.

Built once per step by the model runner (``engine/model_runner.py``) and shared by every
layer (``models/llama.py``). Two attention backends read it: torch's SDPA (decode in
context-length groups, gathered blocks, masks) and the native CPU kernels
(``models/cpu_attention.py``: block tables read in place, no masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's prefill chunk inside the flat batch."""

    start: int
    """Offset of the chunk's first token in the flat batch."""
    num_new: int
    """Tokens computed now."""
    context_len: int
    """Tokens attended to by the chunk's last token (cached prefix + earlier chunks + new)."""
    block_ids: torch.Tensor | None
    """``[num_blocks]`` block table; None when the chunk is the whole context (no gather)."""
    mask: torch.Tensor | None
    """``[num_new, context_len]`` bool, True = attend; None for a plain causal chunk, and always
    None for the native kernel, which masks query ``i`` to keys ``<= context_len - num_new + i``."""


@dataclass(slots=True)
class DecodeGroup:
    """Decode tokens ``start .. start + count`` of the flat batch, attending over contexts
    padded to one length. Decoding sequences are grouped by context length so that one long
    context does not make every short one in the step read (and gather) as many keys."""

    start: int
    count: int
    block_ids: torch.Tensor
    """``[count * max_blocks]`` the sequences' block tables, row after row, each padded with
    block 0 to ``max_blocks`` (flat: one ``index_select`` gathers them all)."""
    context_len: int
    """Key positions read: the longest context of the group."""
    mask: torch.Tensor | None
    """``[count, 1, 1, context_len]`` additive mask in the model dtype (0 = attend, -inf =
    padding); None when every sequence of the group has ``context_len`` tokens of context."""


@dataclass(slots=True)
class DecodeTables:
    """The decode tokens' block tables for the native kernel, which reads blocks in place."""

    block_tables: torch.Tensor
    """int64, every decoding sequence's block table one after another (no padding)."""
    table_starts: torch.Tensor
    """``[num_decodes]`` int64 offset of each sequence's table in ``block_tables``."""
    context_lens: torch.Tensor
    """``[num_decodes]`` int64 key positions each sequence attends (its new token's included)."""


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """``[T]`` flat cache slot (block * block_size + offset) each new token's K/V goes to."""
    num_decodes: int
    """The first ``num_decodes`` tokens are decode tokens, one per sequence."""
    decode_groups: list[DecodeGroup]
    """The decode tokens in groups that tile ``0 .. num_decodes`` (torch's attention)."""
    prefills: list[PrefillSpan]
    decode_tables: DecodeTables | None = None
    """Set when decode attends with the native CPU kernel (``models.cpu_attention``), which
    reads these instead of ``decode_groups``."""
    native_prefill: bool = False
    """Prefill chunks attend with the native CPU kernel (their spans carry no masks)."""
