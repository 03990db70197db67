"""Incremental text of one request, with stop strings.

Text is released as tokens arrive, except the tail that could still turn out to be the start
of a stop string (held back until it can't), so a stop string never reaches the caller.
"""

from __future__ import annotations

from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""
        self._sent = 0
        self.stopped = False

    def add(self, token: int) -> bool:
        """Feed one token; True when a stop string completed (the text is cut before it)."""
        if self.stopped:
            return True
        # A stop string that completes now starts no earlier than `hold` chars before the new text.
        start = max(0, len(self._text) - self._hold)
        self._text += self._detok.add([token])
        for s in self._stop:
            idx = self._text.find(s, start)
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
