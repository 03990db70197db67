"""Named workload mixes: what kind of requests a serving benchmark sends.

A ``Mix`` is a list of request classes, each with a share of the requests and uniform ranges
(both ends included) of prompt and output lengths; a multi-turn mix instead describes
conversations (``Conversation``). Token ids are not part of a mix: ``workload`` draws them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class Span:
    """Integers ``lo..hi``, both ends included, drawn uniformly."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise InvalidArgumentError("span", f"need 1 <= lo <= hi, got {self.lo}..{self.hi}")

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return f"{self.lo}-{self.hi}"


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One kind of request in a mix."""

    name: str
    share: float
    """Probability that a request is of this class (the shares of a mix sum to 1)."""
    prompt: Span
    output: Span


@dataclass(frozen=True, slots=True)
class Conversation:
    """Multi-turn sessions: turn ``k+1``'s prompt is turn ``k``'s prompt, then the answer the
    target gave to it, then ``user`` new tokens. Turn 1's prompt is ``first`` tokens long."""

    turns: Span
    first: Span
    user: Span
    output: Span
    open_sessions: int
    """Sessions in progress at once: each arrival continues one of them (drawn uniformly);
    a session that has sent its last turn is replaced by a new one."""


@dataclass(frozen=True, slots=True)
class Mix:
    """A named workload: independent requests (``classes``) or conversations."""

    name: str
    description: str
    classes: tuple[RequestClass, ...] = ()
    conversation: Conversation | None = None

    def __post_init__(self) -> None:
        if (not self.classes) == (self.conversation is None):
            raise InvalidArgumentError("mix", "needs request classes or a conversation, not both")
        if self.classes and abs(sum(c.share for c in self.classes) - 1.0) > 1e-9:
            raise InvalidArgumentError("mix", f"{self.name}: class shares must sum to 1")

    def draw_class(self, rng: random.Random) -> RequestClass:
        """One request class, by share."""
        x = rng.random()
        for cls in self.classes:
            x -= cls.share
            if x < 0:
                return cls
        return self.classes[-1]  # float round-off of the shares' sum

    def summary(self) -> str:
        """One line: the classes' shares and ranges, or the conversation's shape."""
        if self.conversation is not None:
            c = self.conversation
            return (
                f"{c.turns} turns, first prompt {c.first} tokens, {c.user} new user tokens "
                f"per turn, {c.output} output tokens, {c.open_sessions} sessions open at once"
            )
        return "; ".join(
            f"{c.share:.0%} prompts {c.prompt} tokens -> {c.output} output" for c in self.classes
        )


LONG_PROMPT_HEAVY = Mix(
    "long-prompt-heavy",
    "long prompts with short answers beside short chat turns",
    (
        RequestClass("long", 0.3, Span(1600, 2400), Span(8, 16)),
        RequestClass("short", 0.7, Span(35, 110), Span(48, 96)),
    ),
)
"""30% prompts of 1600-2400 tokens with 8-16 output tokens (summaries, retrieval), 70% prompts
of 35-110 tokens with 48-96 output tokens (chat). The long prefills stall colocated decode
steps, which is what prefill/decode disaggregation is for."""

CHAT = Mix(
    "chat",
    "chat-sized prompts and answers",
    (RequestClass("chat", 1.0, Span(100, 800), Span(64, 256)),),
)
"""Prompts of 100-800 tokens, answers of 64-256 tokens: decode-heavy, moderate prefill."""

SHORT_ONLY = Mix(
    "short-only",
    "short prompts only",
    (RequestClass("short", 1.0, Span(35, 110), Span(48, 96)),),
)
"""The short class of ``long-prompt-heavy`` alone (prompts 35-110, outputs 48-96): the
baseline without long prefills."""

PREFILL_HEAVY = Mix(
    "prefill-heavy",
    "long documents in, short answers out",
    (RequestClass("document", 1.0, Span(3000, 5000), Span(8, 16)),),
)
"""Prompts of 3,000-5,000 tokens, answers of 8-16 tokens (extraction, classification): almost
all prefill. With ``decode-heavy`` it makes the shifting workload of the P:D planner's
benchmark, whose two halves want opposite splits."""

DECODE_HEAVY = Mix(
    "decode-heavy",
    "short questions, long answers",
    (RequestClass("generate", 1.0, Span(32, 96), Span(128, 256)),),
)
"""Prompts of 32-96 tokens, answers of 128-256 tokens (generation): almost all decode."""

MULTI_TURN = Mix(
    "multi-turn",
    "conversations whose turns repeat the whole history (prefix-cache workload)",
    conversation=Conversation(
        turns=Span(2, 5),
        first=Span(200, 600),
        user=Span(30, 120),
        output=Span(32, 128),
        open_sessions=16,
    ),
)
"""Sessions of 2-5 turns; turn 1's prompt is 200-600 tokens, each later turn adds the previous
answer and 30-120 new user tokens; answers are 32-128 tokens. Turn ``k+1`` is sent at its
arrival time or when turn ``k`` has finished, whichever is later, so a prefix cache can serve
the history. A fifth turn's context stays under 1.8K tokens (prompt and answer)."""

MIXES: dict[str, Mix] = {
    m.name: m
    for m in (LONG_PROMPT_HEAVY, CHAT, SHORT_ONLY, PREFILL_HEAVY, DECODE_HEAVY, MULTI_TURN)
}


def get_mix(name: str) -> Mix:
    """The mix called ``name``; a clear error naming the known ones otherwise."""
    try:
        return MIXES[name]
    except KeyError:
        raise InvalidArgumentError("mix", f"unknown mix {name!r}; one of {sorted(MIXES)}") from None
