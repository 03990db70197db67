"""Incremental text of one request, with stop strings.

Text is released as tokens arrive, except the tail that could still turn out to be the start
of a stop string (held back until it can't), so a stop string never reaches the caller.
"""

from __future__ import annotations

from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """``min_tokens``: the text of the first that many tokens ends no stop string (vLLM's
    rule); a stop string that ends in a later token's text counts, even if it began earlier."""

    def __init__(
        self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._min_tokens = min_tokens
        self._tokens = 0
        self._text = ""
        self._sent = 0
        self.stopped = False

    def add(self, token: int) -> bool:
        """Feed one token; True when a stop string completed (the text is cut before it)."""
        if self.stopped:
            return True
        before = len(self._text)
        self._text += self._detok.add([token])
        self._tokens += 1
        if self._tokens <= self._min_tokens:
            return False
        for s in self._stop:
            # Only a stop string that ends in the new text: one that ended earlier was found
            # then, or lies in the text of the first ``min_tokens`` tokens.
            idx = self._text.find(s, max(0, before - len(s) + 1))
            if idx != -1:
                self._text = self._text[:idx]
                self.stopped = True
        return self.stopped

    def take(self, *, final: bool = False) -> str:
        """The text not yet taken; all of it when ``final``."""
        if final and not self.stopped:
            self._text += self._detok.flush()
        end = (
            len(self._text)
            if final or self.stopped
            else max(self._sent, len(self._text) - self._hold)
        )
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    @property
    def text(self) -> str:
        return self._text
