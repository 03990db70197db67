"""Turns logits into tokens: logits controls, greedy, temperature, min-p, top-k, top-p,
per-request seeded RNG.

The rows of the requests that use a logits control this step (penalties, ``logit_bias``,
``allowed_token_ids``, bad words, ``min_tokens``: ``logits_processors``; a structured-output
guide: ``guided``, whose one batched bitmask goes first) are copied out and
processed together before the arg-max or the draw, greedy rows included (as vLLM does). A
batch in which no request uses one takes the plain path: no copy, no extra tensor op. The
logprob reported is always the *raw* model distribution's (before the controls, temperature
and filters), as the API reports it; rows whose request asks for alternatives
(``SamplingParams.logprobs``) also get the top tokens of that raw distribution, in one
``topk`` over those rows (``engine.logprobs``).

No sampling parameter that ``SamplingParams`` accepts makes a draw fail: temperatures below
``GREEDY_TEMPERATURE`` are greedy, and every filter keeps at least the most likely token, so
each row's distribution has a finite, positive mass. What can still fail is the model: a row
of non-finite logits (NaN, +inf) has no distribution. Such a row fails alone (``Samples.failed``)
and the other rows of the batch get their tokens as if it had not been there; so does a row
whose controls mask every token (``allowed_token_ids`` all bad words, say).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.engine.guided import mask_guided
from pdserve.engine.logits_processors import apply_controls, is_controlled, min_p_filter
from pdserve.engine.logprobs import top_logprobs
from pdserve.engine.sequence import Sequence
from pdserve.logprobs import TopLogprobs

_NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class Samples:
    """One token per row, or why the row has none."""

    tokens: list[int]
    logprobs: list[float]
    """Log-probability of each token under the model's raw distribution (before the logits
    controls, temperature and filtering), as the API reports it."""
    failed: dict[int, str]
    """Row -> why no token could be drawn; ``tokens[row]`` is meaningless for these rows."""
    top: dict[int, TopLogprobs]
    """Row -> the most likely tokens of the raw distribution, for the rows whose request asks
    for alternatives (``SamplingParams.logprobs``)."""


def step_seed(seed: int, index: int) -> int:
    """Seed of output token ``index``: a splitmix64-style mix, so nearby seeds don't correlate.

    Deriving each draw from (seed, index) rather than a running generator lets a decode worker
    continue a request whose first token another engine sampled, with the same result.
    """
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


def _draw(row: torch.Tensor, seq: Sequence) -> int:
    """Sample one token of ``row`` (``[vocab]`` float32 logits) under ``seq.params``."""
    p = seq.params
    row = row / p.temperature  # >= GREEDY_TEMPERATURE: finite logits stay finite
    if p.min_p > 0.0:  # vLLM's order: after temperature, before top-k and top-p
        row = min_p_filter(row, p.min_p)
    if 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass *before* it already reaches top_p. The first is always
        # kept: a top_p that rounds to 0 in float32 would otherwise drop them all.
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        drop[0] = False
        row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(row, dim=-1)
    if seq.generator is None:  # made here, where torch is: the engine imports none
        seq.generator = torch.Generator(device=probs.device)
    seq.generator.manual_seed(step_seed(seq.seed, seq.num_output_tokens))
    return int(torch.multinomial(probs, 1, generator=seq.generator)[0])


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> Samples:
    """Pick one token per row of ``logits`` ``[S, vocab]`` (float32) for ``seqs[i]``."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [S, V]
    # max() beats argmax() on CPU by ~2x for [S, 32000] rows; ties resolve to the first index.
    tokens = logits.max(dim=-1).indices  # [S]; overwritten below for controlled/sampled rows
    failed: dict[int, str] = {}
    processed: dict[int, torch.Tensor] = {}  # row -> its logits after the controls
    controlled = [i for i, seq in enumerate(seqs) if is_controlled(seq)]
    if controlled:
        cseqs = [seqs[i] for i in controlled]
        # A copy; the grammars' masks first (as vLLM applies them), then the controls.
        rows = apply_controls(mask_guided(logits[controlled], [s.guide for s in cseqs]), cseqs)
        best = rows.max(dim=-1)
        tokens[controlled] = best.indices
        for j, i in enumerate(controlled):
            processed[i] = rows[j]
        for j in torch.nonzero(best.values == _NEG_INF).flatten().tolist():
            failed[controlled[j]] = (
                "no token is left to sample: the logits controls (or the guide) mask all"
            )
    for i, seq in enumerate(seqs):
        if seq.params.greedy or i in failed:
            continue
        try:
            tokens[i] = _draw(processed.get(i, logits[i]), seq)
        except RuntimeError as err:  # torch refuses a distribution with NaN/inf mass
            failed[i] = f"sampling failed: {err}"
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    for i, lp in enumerate(chosen):
        # A NaN or +inf logit makes the row's log-softmax NaN: the arg-max is no token then.
        if not math.isfinite(lp) and i not in failed:
            failed[i] = "the model's logits are not finite"
    top = top_logprobs(logprobs, [seq.params.logprobs for seq in seqs])
    return Samples(tokens.tolist(), chosen, failed, top)
