"""The log-probabilities a request asks for beyond its sampled token's, computed in batches.

* ``top_logprobs``: the ``k`` most likely tokens of the rows that ask for them
  (``SamplingParams.logprobs``), one ``topk`` over those rows with the largest ``k`` asked;
  nothing is computed when no row asks.
* ``PromptRows``: for requests with ``SamplingParams.prompt_logprobs``, the rows of a step's
  token batch whose logits give the next prompt token's logprob. The model runner asks the
  model for the logits of those rows too (it otherwise computes only the sampled rows'), and
  ``PromptRows.split`` turns them into each request's ``PromptLogprobs`` piece: the target
  token's logprob, its rank and the alternatives, for all rows at once.

Every value comes from ``log_softmax`` of the raw float32 logits (``docs/sampling.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.sequence import Sequence
from pdserve.logprobs import PromptLogprobs, TopLogprobs


def top_logprobs(logprobs: torch.Tensor, ks: list[int]) -> dict[int, TopLogprobs]:
    """Row -> its ``ks[row]`` most likely tokens, for the rows of ``logprobs`` ``[S, V]``
    with ``ks[row] > 0``."""
    rows = [i for i, k in enumerate(ks) if k > 0]
    if not rows:
        return {}
    k = min(max(ks[i] for i in rows), logprobs.shape[-1])
    picked = logprobs if len(rows) == logprobs.shape[0] else logprobs[rows]
    values, ids = torch.topk(picked, k, dim=-1)  # sorted, most likely first
    out: dict[int, TopLogprobs] = {}
    for row, vals, tokens in zip(rows, values.tolist(), ids.tolist(), strict=True):
        n = ks[row]
        out[row] = TopLogprobs(tuple(tokens[:n]), tuple(vals[:n]))
    return out


@dataclass(slots=True)
class PromptRows:
    """Rows of one step's token batch whose logits give prompt logprobs (see the module
    docstring). The logits of row ``positions[i]`` predict ``targets[i]``."""

    positions: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)
    owners: list[tuple[Sequence, int]] = field(default_factory=list)
    """(sequence, its number of rows), in the order of ``positions``."""

    def add(self, seq: Sequence, first_row: int, num_tokens: int) -> None:
        """The rows of a prompt chunk of ``seq`` computed at ``first_row`` onwards: those whose
        next token is a prompt token it has no logprob of yet."""
        pl = seq.prompt_logprobs
        if pl is None or not seq.wants_prompt_logprobs:
            return
        p0, done = seq.num_computed_tokens, len(pl.logprobs)
        if p0 > done:  # the positions in between were not computed here: nothing to align
            return
        end = min(p0 + num_tokens, seq.num_prompt_tokens - 1)
        positions = range(done, end)  # logits at position p predict token p + 1
        if not positions:
            return
        k = seq.params.prompt_logprobs or 0
        self.positions += [first_row + p - p0 for p in positions]
        self.targets += seq.token_ids[done + 1 : end + 1]
        self.ks += [k] * len(positions)
        self.owners.append((seq, len(positions)))

    def split(self, logits: torch.Tensor) -> dict[str, PromptLogprobs]:
        """Request id -> its piece, from ``logits`` ``[len(positions), V]`` (float32)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(self.targets, dtype=torch.long, device=logits.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1))  # [N, 1]
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        values = chosen.squeeze(1).tolist()
        tops = top_logprobs(logprobs, self.ks)
        out: dict[str, PromptLogprobs] = {}
        start = 0
        for seq, n in self.owners:
            rows = range(start, start + n)
            out[seq.request_id] = PromptLogprobs(
                logprobs=values[start : start + n],
                ranks=ranks[start : start + n],
                top=[tops[r] for r in rows if r in tops],
            )
            start += n
        return out
