"""Log-probabilities beyond the sampled token's: the most likely alternatives at each position
(``TopLogprobs``) and the log-probabilities of a prompt's own tokens (``PromptLogprobs``).

One type for every layer: the engine computes them, the workers and the router carry them
(``TopLogprobs``/``PromptLogprobs`` in ``protos/pdserve/v1/common.proto``), the SDK returns them
and the HTTP gateway renders them in OpenAI's shapes. Every value is a log-probability under
the model's raw distribution at that position (before the logits controls, temperature and
filters), as the sampled token's own logprob is (``docs/sampling.md``).

Imports nothing heavy (no torch, no grpc): the client SDK uses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
"""Alternatives per position at most (``SamplingParams.logprobs``/``prompt_logprobs``): vLLM's
default ``--max-logprobs`` and OpenAI's bound on ``top_logprobs``."""


@dataclass(frozen=True, slots=True)
class TopLogprobs:
    """The ``k`` most likely tokens at one position, most likely first (ties: lower id first)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("TopLogprobs: token_ids and logprobs differ in length")


@dataclass(slots=True)
class PromptLogprobs:
    """The log-probability of each prompt token after the first, given the tokens before it
    (the first token has none: nothing predicts it).

    ``token_ids`` holds the whole prompt (``n`` ids); the other lists hold ``n - 1`` entries,
    entry ``i`` about ``token_ids[i + 1]``. ``top`` is empty when no alternatives were asked.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    """1 + how many tokens the model found more likely at that position."""
    top: list[TopLogprobs] = field(default_factory=list)

    def extend(
        self, logprobs: Sequence[float], ranks: Sequence[int], top: Sequence[TopLogprobs]
    ) -> None:
        """Append the entries of the next prompt positions."""
        self.logprobs += logprobs
        self.ranks += ranks
        self.top += top
