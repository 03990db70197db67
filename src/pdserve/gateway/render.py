"""SDK results -> OpenAI response objects: choices, stream chunks, logprobs, usage.

The router reports each generated token's log-probability under the sampling distribution;
the engine computes no alternatives, so OpenAI's "top" logprobs list the sampled token alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.client import Completion as ClientCompletion
from pdserve.client import Delta
from pdserve.client import Usage as ClientUsage
from pdserve.gateway.responses import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from pdserve.tokenizer import Tokenizer


def token_texts(tokenizer: Tokenizer, token_ids: Sequence[int]) -> list[str]:
    """Each token's own text (special tokens kept; a partial UTF-8 character is U+FFFD)."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    *,
    top: int,
    offset: int = 0,
) -> CompletionLogprobs:
    """Legacy logprobs of some tokens; ``offset`` is where their text starts in the choice."""
    tokens = token_texts(tokenizer, token_ids)
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=list(logprobs),
        top_logprobs=[{t: lp} for t, lp in zip(tokens, logprobs, strict=True)] if top else [],
        text_offset=offsets,
    )


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[float], *, top: int
) -> ChatLogprobs:
    """Chat logprobs of some tokens."""
    content = []
    for token, lp in zip(token_texts(tokenizer, token_ids), logprobs, strict=True):
        raw = list(token.encode("utf-8"))
        tops = [TopLogprob(token=token, logprob=lp, bytes=raw)] if top else []
        content.append(TokenLogprob(token=token, logprob=lp, bytes=raw, top_logprobs=tops))
    return ChatLogprobs(content=content)


def _usage_or_zero(usage: ClientUsage | None) -> ClientUsage:
    return usage if usage is not None else ClientUsage(0, 0, 0)


def batch_usage(completions: Sequence[ClientCompletion], n: int) -> Usage:
    """Usage of a whole answer: each prompt's tokens once (from its first choice), every
    choice's completion tokens."""
    usages = [_usage_or_zero(c.usage) for c in completions]
    return Usage.total(usages[::n], sum(u.completion_tokens for u in usages))


@dataclass(slots=True)
class StreamTally:
    """Per-choice state of a stream: text offsets for logprobs, usage for the last chunk."""

    n: int
    offsets: dict[int, int] = field(default_factory=dict)
    usages: dict[int, ClientUsage] = field(default_factory=dict)

    def advance(self, index: int, text: str) -> int:
        """The offset where ``text`` starts in choice ``index``; moves past it."""
        start = self.offsets.get(index, 0)
        self.offsets[index] = start + len(text)
        return start

    def add_final(self, index: int, delta: Delta) -> None:
        if delta.usage is not None:
            self.usages[index] = delta.usage

    def usage(self) -> Usage:
        indices = sorted(self.usages)
        per_prompt = [self.usages[i] for i in indices if i % self.n == 0]
        return Usage.total(per_prompt, sum(self.usages[i].completion_tokens for i in indices))
