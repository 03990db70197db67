"""The text of one response, built from its tokens as they stream in."""

from __future__ import annotations

from pdserve.engine.text import TextStream
from pdserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


class ResponseText:
    """Incremental text with stop strings: deltas never split a UTF-8 character.

    With ``skip_special_tokens`` (the usual case) this is the engine's own ``TextStream``, so
    the router cuts stop strings exactly where the workers' engines detect them. Without it,
    special tokens are rendered and stop strings are matched on that text. Either way the text
    of the first ``min_tokens`` tokens ends no stop string, as in the engine.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: tuple[str, ...],
        *,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._stream: TextStream | None = None
        self._detok: IncrementalDetokenizer | None = None
        self._matcher: StopStringMatcher | None = None
        self._min_tokens = min_tokens
        self._tokens = 0
        if skip_special_tokens:
            self._stream = TextStream(tokenizer, stop, min_tokens)
        else:
            self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
            self._matcher = StopStringMatcher(stop)
        self._ready: list[str] = []
        self.stopped = False
        """True once a stop string completed; later tokens add no text."""

    def add(self, token: int) -> bool:
        """Feed one token; True when a stop string has completed."""
        if self.stopped:
            return True
        if self._stream is not None:
            self.stopped = self._stream.add(token)
            return self.stopped
        assert self._detok is not None and self._matcher is not None  # set together in __init__
        self._tokens += 1
        delta = self._detok.add([token])
        out, matched = self._matcher.feed(delta, match=self._tokens > self._min_tokens)
        self._ready.append(out)
        self.stopped = matched is not None
        return self.stopped

    def take(self, *, final: bool = False) -> str:
        """Text not yet taken; everything that is left when ``final``."""
        if self._stream is not None:
            return self._stream.take(final=final)
        assert self._detok is not None and self._matcher is not None
        if final and not self.stopped:
            out, matched = self._matcher.feed(
                self._detok.flush(), match=self._tokens > self._min_tokens
            )
            self._ready.append(out)
            if matched is None:
                self._ready.append(self._matcher.flush())
        delta = "".join(self._ready)
        self._ready.clear()
        return delta
