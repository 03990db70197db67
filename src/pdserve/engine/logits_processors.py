"""vLLM's logits controls, applied to a batch of rows at once.

``apply_controls`` takes the rows ``[C, V]`` of the requests that use a control this step
(``is_controlled``) and applies, in vLLM's order:

1. ``allowed_token_ids``: every other token to -inf;
2. ``bad_words_token_ids``: a one-token word to -inf; a longer word's last token to -inf when
   the output ends with the word's other tokens (vLLM matches the output only, not the prompt);
3. ``min_tokens``: the stop tokens (``stop_token_ids``, the engine's EOS among them) to -inf
   while the output is shorter;
4. ``logit_bias``: added;
5. penalties: ``repetition_penalty`` over the tokens of the prompt and the output (a positive
   logit divided by it, the others multiplied), then OpenAI's
   ``logits -= frequency_penalty * count + presence_penalty * (count > 0)`` over the output.

Each is a handful of tensor ops over the whole ``[C, V]`` block: the per-request Python work
is gathering the few ids each request names (and, for the penalties, its token ids) into flat
index tensors, never a loop over the vocabulary. ``min_p`` is not among them: the sampler
applies ``min_p_filter`` to the sampled distribution after temperature (argmax-invariant, so
greedy rows skip it), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pdserve.engine.controls import banned_by_bad_words, is_controlled, tokenize_bad_words
from pdserve.engine.sequence import Sequence as Seq

__all__ = [
    "apply_controls",
    "banned_by_bad_words",
    "is_controlled",
    "min_p_filter",
    "tokenize_bad_words",
]

_NEG_INF = float("-inf")


def apply_controls(logits: torch.Tensor, seqs: Sequence[Seq]) -> torch.Tensor:
    """``logits`` ``[C, V]`` (one row per sequence of ``seqs``, each ``is_controlled``), with
    the controls applied in place; returns it."""
    allowed = [(i, s.params.allowed_token_ids) for i, s in enumerate(seqs)]
    if any(ids for _, ids in allowed):
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[_index([(i, ids) for i, ids in allowed if ids], logits.device)] = True
        keep[[i for i, ids in allowed if not ids]] = True
        logits.masked_fill_(~keep, _NEG_INF)
    masked: list[tuple[int, Sequence[int]]] = [
        (i, banned_by_bad_words(s.params.bad_words_token_ids, s.output_token_ids))
        for i, s in enumerate(seqs)
        if s.params.bad_words_token_ids
    ]
    masked += [
        (i, s.params.stop_token_ids)
        for i, s in enumerate(seqs)
        if s.num_output_tokens < s.params.min_tokens
    ]
    if any(ids for _, ids in masked):
        logits[_index(masked, logits.device)] = _NEG_INF
    biased = [(i, s.params.logit_bias) for i, s in enumerate(seqs) if s.params.logit_bias]
    if biased:
        index = _index([(i, tuple(b)) for i, b in biased], logits.device)
        values = logits.new_tensor([v for _, b in biased for v in b.values()])
        logits.index_put_(index, values, accumulate=True)
    penalized = [i for i, s in enumerate(seqs) if s.params.penalized]
    if penalized:
        _penalize(logits, penalized, seqs)
    return logits


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """``logits`` ``[..., V]`` with the tokens less likely than ``min_p`` times the most likely
    one at -inf (the most likely always stays). A new tensor."""
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), _NEG_INF)


def _penalize(logits: torch.Tensor, rows: list[int], seqs: Sequence[Seq]) -> None:
    """The penalties of ``seqs[r]`` on ``logits[r]`` for each ``r`` in ``rows``, in place.

    Only the entries of tokens that occur change, so the updates gather and scatter those
    alone, at the flat indices ``row * V + token`` of the prompt and output tokens. An index
    that repeats (a token seen twice) computes the same value from the same gathered one, so
    the repeated writes agree. The output counts come from one ``scatter_add_`` of ones.
    """
    vocab = logits.shape[-1]
    flat = logits.view(-1)  # a view: writes land in ``logits``
    # Per-row values, indexed by each entry's row (a row without penalties has the neutral
    # defaults, and no entries anyway).
    rep = logits.new_tensor([s.params.repetition_penalty for s in seqs])
    freq = logits.new_tensor([s.params.frequency_penalty for s in seqs])
    presence = logits.new_tensor([s.params.presence_penalty for s in seqs])
    out_rows, out_ids = _index([(r, seqs[r].output_token_ids) for r in rows], logits.device)
    outputs = out_rows * vocab + out_ids
    repeated = [r for r in rows if seqs[r].params.repetition_penalty != 1.0]
    if repeated:
        prompts = [(r, seqs[r].token_ids[: seqs[r].num_prompt_tokens]) for r in repeated]
        in_rows, in_ids = _index(prompts, logits.device)
        seen = torch.cat([in_rows * vocab + in_ids, outputs])
        values, by = flat[seen], rep[seen // vocab]
        flat[seen] = torch.where(values > 0, values / by, values * by)
    if len(outputs) and bool((freq != 0).any() or (presence != 0).any()):
        counts = torch.zeros_like(flat).scatter_add_(0, outputs, torch.ones_like(flat[outputs]))
        flat[outputs] = flat[outputs] - freq[out_rows] * counts[outputs] - presence[out_rows]


def _index(
    rows_ids: Sequence[tuple[int, Sequence[int]]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, token id) int64 index tensors of each row's ids, for one advanced-index
    access. Built with numpy: a Python list becomes an array several times faster than it
    becomes a tensor."""
    lengths = [len(ids) for _, ids in rows_ids]
    rows = np.repeat(np.asarray([r for r, _ in rows_ids], dtype=np.int64), lengths)
    cols = np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in rows_ids] or [rows[:0]])
    return torch.from_numpy(rows).to(device), torch.from_numpy(cols).to(device)
