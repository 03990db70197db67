"""Per-request sampling parameters, validated at the door."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters.
    """

    temperature: float = 1.0
    """Softmax temperature; 0 selects the arg-max token (greedy)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set whose probability mass reaches top_p, in (0, 1]."""
    seed: int | None = None
    """Per-request seed: the same seed, prompt and parameters give the same tokens."""
    max_tokens: int = 16
    """Tokens to generate at most (the first token counts)."""
    stop_token_ids: tuple[int, ...] = ()
    """Finish when one of these tokens is sampled (it is kept in the output)."""
    stop: tuple[str, ...] = ()
    """Finish when the text contains one of these strings (the output is cut before it)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence token."""
    stop_token_set: frozenset[int] = field(
        default=frozenset(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, int | float) or math.isnan(self.temperature):
            raise InvalidArgumentError(
                "temperature", f"must be a number >= 0, got {self.temperature!r}"
            )
        if self.temperature < 0 or math.isinf(self.temperature):
            raise InvalidArgumentError(
                "temperature", f"must be finite and >= 0, got {self.temperature}"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgumentError(
                "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}"
            )
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgumentError("seed", f"must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidArgumentError("stop", "stop strings must be non-empty")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_set", frozenset(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_against(self, *, vocab_size: int, max_model_len: int, prompt_len: int) -> None:
        """Validate the parameters that depend on the model and the prompt."""
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise InvalidArgumentError("stop_token_ids", f"token {t} outside [0, {vocab_size})")
        if prompt_len + self.max_tokens > max_model_len:
            raise InvalidArgumentError(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds the "
                f"model's maximum length {max_model_len}",
            )
