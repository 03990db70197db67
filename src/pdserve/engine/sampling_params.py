"""Per-request sampling parameters, validated at the door."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pdserve.engine.guide import Guide
from pdserve.errors import InvalidArgumentError
from pdserve.logprobs import MAX_LOGPROBS

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this (0 included) select the arg-max token: dividing float32 logits by
a smaller one overflows them (to inf, then NaN probabilities), and at this temperature the
distribution has long been a point mass on the arg-max anyway."""


PENALTY_RANGE = 2.0
"""``presence_penalty`` and ``frequency_penalty`` lie in [-PENALTY_RANGE, PENALTY_RANGE]."""
LOGIT_BIAS_RANGE = 100.0
"""Each ``logit_bias`` value lies in [-LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE] (OpenAI's range)."""


def _finite(value: object) -> float | None:
    """``value`` as a float if it is a finite real number (not a bool), else None."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        f = float(value)
    except OverflowError:  # an int beyond the float range
        return None
    return f if math.isfinite(f) else None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: Iterable[object], name: str) -> tuple[int, ...]:
    """``value`` (an iterable of ints) as a tuple; ``name`` is the field a bad one names."""
    try:
        ids = tuple(value)
    except TypeError:
        raise InvalidArgumentError(name, f"must be a list of token ids, got {value!r}") from None
    out = tuple(t for t in ids if isinstance(t, int) and not isinstance(t, bool) and t >= 0)
    if len(out) != len(ids):
        raise InvalidArgumentError(name, "must be integer token ids >= 0")
    return out


def _in_range(value: object, name: str, low: float, high: float) -> float:
    f = _finite(value)
    if f is None or not low <= f <= high:
        raise InvalidArgumentError(name, f"must be a number in [{low:g}, {high:g}], got {value!r}")
    return f


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1`` disable those filters.
    Every value that passes the checks samples without error: a temperature below
    ``GREEDY_TEMPERATURE`` is greedy, and top-p keeps at least the most likely token however
    small it is.

    The logits controls (penalties, ``logit_bias``, ``allowed_token_ids``, ``bad_words``,
    ``min_tokens``) are vLLM's, applied in vLLM's order to greedy and sampled requests alike
    (``engine.logits_processors``); ``min_p`` filters the sampled distribution only, after
    temperature. Their defaults leave the logits untouched.
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
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from the logit of each token the output already contains, in
    [-2, 2]; 0 is off. Counts output tokens only."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time the output contains it, in
    [-2, 2]; 0 is off. Counts output tokens only."""
    repetition_penalty: float = 1.0
    """CTRL's (as vLLM and HF transformers apply it), > 0; 1 is off: the logit of every token
    in the prompt or the output is divided by it when positive, multiplied when not."""
    min_p: float = 0.0
    """In [0, 1]: drop the tokens whose probability (after temperature) is below ``min_p``
    times the most likely token's; 0 is off. No effect on greedy requests."""
    min_tokens: int = 0
    """Output tokens before the end-of-sequence token, ``stop_token_ids`` or a ``stop``
    string may end the request (the tokens are masked, stop strings in their text ignored);
    at most ``max_tokens``."""
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    """Token id -> value in [-100, 100] added to its logit."""
    allowed_token_ids: tuple[int, ...] = ()
    """Only these tokens may be drawn; empty allows all."""
    bad_words: tuple[str, ...] = ()
    """Words never to generate, as text: the router (or the engine) tokenizes them into
    ``bad_words_token_ids`` as vLLM does (each word alone and after a space)."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """Token sequences never to generate: a one-token word is always masked; a longer one has
    its last token masked whenever the output ends with the word's other tokens."""
    logprobs: int = 0
    """Alternatives to report at each output token: its ``logprobs`` most likely tokens and
    their log-probabilities, in [0, ``MAX_LOGPROBS``] (the sampled token's own log-probability
    is always reported)."""
    prompt_logprobs: int | None = None
    """Report the log-probability of each prompt token (after the first) given the tokens
    before it, with this many alternatives, in [0, ``MAX_LOGPROBS``]; None: none. Computed by
    the engine that prefills the prompt (never from its prefix cache: the logits of every
    prompt position are needed)."""
    guide: Guide | None = None
    """Structured output: what the output must be (a JSON schema, a regex, ...); the engine
    masks every token that would leave it (``engine.guided``). None: free text."""
    stop_token_set: frozenset[int] = field(
        default=frozenset(), init=False, repr=False, compare=False
    )
    has_logits_controls: bool = field(default=False, init=False, repr=False, compare=False)
    """Some control other than ``min_tokens`` and ``min_p`` changes the logits at every step."""

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
        self._check_controls()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise InvalidArgumentError(
                    name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        if self.logprobs is None:
            raise InvalidArgumentError("logprobs", "must be an integer, not None")

    def _check_controls(self) -> None:
        _in_range(self.presence_penalty, "presence_penalty", -PENALTY_RANGE, PENALTY_RANGE)
        _in_range(self.frequency_penalty, "frequency_penalty", -PENALTY_RANGE, PENALTY_RANGE)
        r = _finite(self.repetition_penalty)
        if r is None or not r > 0:
            raise InvalidArgumentError(
                "repetition_penalty",
                f"must be a finite number > 0, got {self.repetition_penalty!r}",
            )
        _in_range(self.min_p, "min_p", 0.0, 1.0)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgumentError(
                "min_tokens",
                f"must be an integer in [0, max_tokens = {self.max_tokens}], "
                f"got {self.min_tokens!r}",
            )
        if not isinstance(self.logit_bias, Mapping):
            raise InvalidArgumentError("logit_bias", "must map token ids to numbers")
        bias: dict[int, float] = {}
        for token, value in self.logit_bias.items():
            if not _is_int(token) or token < 0:
                raise InvalidArgumentError("logit_bias", f"key {token!r} is not a token id")
            bias[token] = _in_range(value, "logit_bias", -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
        object.__setattr__(self, "logit_bias", bias)  # a copy: the caller's dict may change
        allowed = _token_ids(self.allowed_token_ids, "allowed_token_ids")
        object.__setattr__(self, "allowed_token_ids", allowed)
        words = tuple(self.bad_words)
        if any(not isinstance(w, str) or not w.strip() for w in words):
            raise InvalidArgumentError("bad_words", "must be strings that are not blank")
        object.__setattr__(self, "bad_words", words)
        sequences = tuple(_token_ids(w, "bad_words_token_ids") for w in self.bad_words_token_ids)
        if any(not w for w in sequences):
            raise InvalidArgumentError("bad_words_token_ids", "every word needs a token id")
        object.__setattr__(self, "bad_words_token_ids", sequences)
        if self.guide is not None and not isinstance(self.guide, Guide):
            raise InvalidArgumentError("guide", f"must be a Guide, got {self.guide!r}")
        controls = bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or bias or allowed or sequences
        )  # fmt: skip
        object.__setattr__(self, "has_logits_controls", controls)

    @property
    def greedy(self) -> bool:
        """The arg-max token is taken (no random draw)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """A penalty counts the tokens of the prompt or the output."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def first_token_only(self) -> SamplingParams:
        """These parameters for the first output token alone (a prefill's): ``max_tokens`` 1,
        and ``min_tokens`` still masking the stop tokens if it did."""
        return dataclasses.replace(self, max_tokens=1, min_tokens=min(self.min_tokens, 1))

    def without_prompt_logprobs(self) -> SamplingParams:
        """These parameters for an engine that continues a request another one prefilled: the
        prompt's logprobs came with the prefill's answer."""
        if self.prompt_logprobs is None:
            return self
        return dataclasses.replace(self, prompt_logprobs=None)

    def after(self, drawn: int) -> SamplingParams:
        """These parameters for the rest of a request whose first ``drawn`` output tokens
        were drawn elsewhere (fewer than ``max_tokens``)."""
        return dataclasses.replace(
            self,
            max_tokens=self.max_tokens - drawn,
            min_tokens=max(0, self.min_tokens - drawn),
        )

    def check_against(self, *, vocab_size: int, max_model_len: int, prompt_len: int) -> None:
        """Validate the parameters that depend on the model and the prompt."""
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise InvalidArgumentError("stop_token_ids", f"token {t} outside [0, {vocab_size})")
        for name, ids in (
            ("logit_bias", self.logit_bias),
            ("allowed_token_ids", self.allowed_token_ids),
            *(("bad_words_token_ids", w) for w in self.bad_words_token_ids),
        ):
            for t in ids:
                if t >= vocab_size:
                    raise InvalidArgumentError(name, f"token {t} outside [0, {vocab_size})")
        if self.allowed_token_ids:
            banned = {w[0] for w in self.bad_words_token_ids if len(w) == 1}
            if banned.issuperset(self.allowed_token_ids):
                raise InvalidArgumentError(
                    "allowed_token_ids", "every allowed token is also a one-token bad word"
                )
        if prompt_len + self.max_tokens > max_model_len:
            raise InvalidArgumentError(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds the "
                f"model's maximum length {max_model_len}",
            )
