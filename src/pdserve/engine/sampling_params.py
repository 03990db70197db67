"""Per-request sampling parameters, validated at the door."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.errors import InvalidArgumentError

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this (0 included) select the arg-max token: dividing float32 logits by
a smaller one overflows them (to inf, then NaN probabilities), and at this temperature the
distribution has long been a point mass on the arg-max anyway."""


def _finite(value: object) -> float | None:
    """``value`` as a float if it is a finite real number (not a bool), else None."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        f = float(value)
    except OverflowError:  # an int beyond the float range
        return None
    return f if math.isfinite(f) else None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters.
    Every value that passes the checks samples without error: a temperature below
    ``GREEDY_TEMPERATURE`` is greedy, and top-p keeps at least the most likely token however
    small it is.
    """

    temperature: float = 1.0
    """Softmax temperature, finite and >= 0; below ``GREEDY_TEMPERATURE`` (0 included) selects
    the arg-max token (greedy)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set whose probability mass reaches top_p, in (0, 1]
    (the most likely token is always kept)."""
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
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        t = _finite(self.temperature)
        if t is None or t < 0:
            raise InvalidArgumentError(
                "temperature", f"must be a finite number >= 0, got {self.temperature!r}"
            )
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidArgumentError("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        p = _finite(self.top_p)
        if p is None or not 0.0 < p <= 1.0:
            raise InvalidArgumentError("top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgumentError(
                "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise InvalidArgumentError("seed", f"must be an integer in [0, 2**63), got {self.seed}")
        if any(not isinstance(i, int) for i in self.stop_token_ids):
            raise InvalidArgumentError("stop_token_ids", "must be integers")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidArgumentError("stop", "stop strings must be non-empty strings")
        object.__setattr__(self, "stop_token_set", frozenset(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """The arg-max token is taken (no random draw)."""
        return self.temperature < GREEDY_TEMPERATURE

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
