"""SDK results -> OpenAI response objects: logprobs in OpenAI's and vLLM's shapes, usage.

The router reports each generated token's log-probability, and with ``logprobs=k`` the k
most likely tokens at its position (``TopLogprobs``), and with ``prompt_logprobs`` those of
the prompt (``PromptLogprobs``); this module writes them as the APIs do:

* completions (``CompletionLogprobs``): per token its text, logprob, a dict of the k most
  likely tokens' texts to their logprobs with the sampled token added (so up to k + 1
  entries, as OpenAI documents), and its text offset (the sum of the texts before it). With
  ``echo`` the prompt's tokens come first, the first with ``null`` logprob and dict;
* chat (``ChatLogprobs``): per token ``{token, logprob, bytes, top_logprobs: [k entries]}``;
* vLLM's ``prompt_logprobs``: ``[null, {id: {logprob, rank, decoded_token}}, ...]``: the
  prompt's token and its alternatives at each position after the first.
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
    PromptLogprobList,
    PromptTokenLogprob,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from pdserve.logprobs import PromptLogprobs, TopLogprobs
from pdserve.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class TokenTexts:
    """How a token is written in logprobs: its own text (special tokens kept; a partial UTF-8
    character is U+FFFD), or ``token_id:{id}`` (vLLM's ``return_tokens_as_token_ids``)."""

    tokenizer: Tokenizer
    as_ids: bool = False

    def __call__(self, token: int) -> str:
        if self.as_ids:
            return f"token_id:{token}"
        return self.tokenizer.decode([token], skip_special_tokens=False)


def _with_sampled(
    text: TokenTexts, top: TopLogprobs | None, token: int, logprob: float
) -> dict[str, float]:
    """The legacy dict: the alternatives, and the sampled token whether among them or not."""
    out = (
        {}
        if top is None
        else {text(t): lp for t, lp in zip(top.token_ids, top.logprobs, strict=True)}
    )
    out.setdefault(text(token), logprob)
    return out


def completion_logprobs(
    text: TokenTexts,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[TopLogprobs],
    *,
    offset: int = 0,
    prompt: PromptLogprobs | None = None,
) -> CompletionLogprobs:
    """Legacy logprobs of some tokens whose text starts at ``offset`` in the choice's text;
    each token's offset adds the texts of the tokens before it. ``prompt``: ``echo``'s tokens,
    written first from offset 0 (``offset`` is then where the echoed prompt's text ends)."""
    out = CompletionLogprobs()
    if prompt is not None:
        prompt_tops: Sequence[TopLogprobs | None] = prompt.top or [None] * len(prompt.logprobs)
        out.top_logprobs.append(None)
        out.token_logprobs.append(None)
        for token, lp, top in zip(prompt.token_ids[1:], prompt.logprobs, prompt_tops, strict=True):
            out.token_logprobs.append(lp)
            out.top_logprobs.append(_with_sampled(text, top, token, lp))
        _offsets(out, text, prompt.token_ids, 0)
    for i, (token, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        out.token_logprobs.append(lp)
        out.top_logprobs.append(_with_sampled(text, tops[i] if tops else None, token, lp))
    _offsets(out, text, token_ids, offset)
    return out


def _offsets(out: CompletionLogprobs, text: TokenTexts, ids: Sequence[int], offset: int) -> None:
    for token in ids:
        token_text = text(token)
        out.tokens.append(token_text)
        out.text_offset.append(offset)
        offset += len(token_text)


def _entry(text: TokenTexts, token: int, logprob: float) -> TopLogprob:
    token_text = text(token)
    return TopLogprob(token=token_text, logprob=logprob, bytes=list(token_text.encode("utf-8")))


def chat_logprobs(
    text: TokenTexts,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[TopLogprobs],
) -> ChatLogprobs:
    """Chat logprobs of some tokens; ``tops`` empty: ``top_logprobs: 0`` (or none asked)."""
    content = []
    for i, (token, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        entry = _entry(text, token, lp)
        alternatives = tops[i] if tops else TopLogprobs((), ())
        content.append(
            TokenLogprob(
                **entry.model_dump(),
                top_logprobs=[
                    _entry(text, t, v)
                    for t, v in zip(alternatives.token_ids, alternatives.logprobs, strict=True)
                ],
            )
        )
    return ChatLogprobs(content=content)


def prompt_logprob_list(
    text: TokenTexts, prompt: PromptLogprobs | None
) -> PromptLogprobList | None:
    """vLLM's ``prompt_logprobs`` (see the module docstring); None when none were asked."""
    if prompt is None:
        return None
    out: PromptLogprobList = [None]
    tops = prompt.top or [TopLogprobs((), ())] * len(prompt.logprobs)
    rows = zip(prompt.token_ids[1:], prompt.logprobs, prompt.ranks, tops, strict=True)
    for token, lp, rank, top in rows:
        entries = {str(token): PromptTokenLogprob(logprob=lp, rank=rank, decoded_token=text(token))}
        for j, (t, v) in enumerate(zip(top.token_ids, top.logprobs, strict=True)):
            entries.setdefault(
                str(t), PromptTokenLogprob(logprob=v, rank=j + 1, decoded_token=text(t))
            )
        out.append(entries)
    return out


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
    tokens: dict[int, int] = field(default_factory=dict)
    """Completion tokens of each choice so far."""

    def advance(self, index: int, text: str) -> int:
        """The offset where ``text`` starts in choice ``index``; moves past it."""
        start = self.offsets.get(index, 0)
        self.offsets[index] = start + len(text)
        return start

    def add_final(self, index: int, delta: Delta) -> None:
        self.tokens[index] = self.tokens.get(index, 0) + len(delta.token_ids)
        if delta.usage is not None:
            self.usages[index] = delta.usage

    def so_far(self, index: int, prompt_tokens: int) -> Usage:
        """Choice ``index``'s usage up to its latest piece (vLLM's ``continuous_usage_stats``):
        the final figures once its last piece is in."""
        final = self.usages.get(index)
        if final is not None:
            return Usage.total([final], final.completion_tokens)
        return Usage.total([ClientUsage(prompt_tokens, 0)], self.tokens.get(index, 0))

    def usage(self) -> Usage:
        indices = sorted(self.usages)
        per_prompt = [self.usages[i] for i in indices if i % self.n == 0]
        return Usage.total(per_prompt, sum(self.usages[i].completion_tokens for i in indices))
