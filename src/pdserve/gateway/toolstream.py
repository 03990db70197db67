"""Tool calls in a streamed answer, parsed as its text arrives (the rules: ``toolparse``).

``call_stream(rules)`` reads one choice: ``feed(text)`` takes each new piece of its text and
returns the delta to send for it (``final=True`` with the last). A delta holds content as long as
the text cannot be a call; once a call's name is known and its arguments begin, the call's
first piece (``index``, ``id``, ``type``, ``function.name``, ``arguments: ""``), then its
arguments' text piece by piece, as OpenAI streams them. Only what might still turn out to be
a call is held back: a text ending in ``<tool_`` is sent up to the ``<``, and the rest waits
for the next piece; a ``<tool_call>`` whose JSON fails before its arguments begin (a bad name,
an error, the end of the answer) is sent as text after all.

What a stream cannot do is take back a call it has begun: arguments that turn out not to be
JSON, or are cut short by ``max_tokens``, stay as sent (the whole answer's parse would call it
text, or drop it), and the text after the error is content. A guided answer
(``required``, ``named``) is JSON by construction, so there only a cut can do that, and its
``finish_reason`` is then ``length``.
"""

from __future__ import annotations

from pdserve.gateway.responses import ChatDelta
from pdserve.gateway.toolparse import (
    HERMES_CLOSE,
    HERMES_OPEN,
    PYTHON_TAG,
    WHITESPACE,
    CallRules,
    CallSyntax,
    ControlEscaper,
    new_call_id,
)
from pdserve.gateway.toolscan import CallScanner, DeltaOut, JsonValue, Step


class CallStream:
    """One streamed choice's content and calls (see the module docstring)."""

    def __init__(self, rules: CallRules) -> None:
        self.rules = rules
        self.out = DeltaOut()
        self.count = 0
        """Calls committed, taken or dropped (``max_calls``)."""
        self.call: CallScanner | None = None
        self.held = ""
        """Text held back: it may begin a call."""
        self.segment_has_text = False
        self.segment_ws = ""
        """The current text between calls, while it is only whitespace."""
        self.state = "start"

    @property
    def calls(self) -> int:
        """Calls sent so far."""
        limit = self.rules.max_calls
        return self.count if limit is None else min(self.count, limit)

    def feed(self, text: str, *, final: bool = False) -> ChatDelta:
        """The delta of the answer's next ``text``; ``final``: it is the last, and what was
        held back is settled too."""
        self._run(text)
        if final:
            while (again := self._flush()) is not None:
                self._run(again)
            if not self.count:
                self.out.content.append(self.segment_ws)
        return self.out.take()

    def _run(self, text: str) -> None:
        todo = [text]  # a stack: text handed back to go through again comes first
        while todo:
            chunk = todo.pop()
            for i, c in enumerate(chunk):
                again = self._char(c)
                if again:
                    todo += [chunk[i + 1 :], again]
                    break

    def _text(self, text: str) -> None:
        """Content, unless it is only whitespace between calls."""
        if self.segment_has_text:
            self.out.content.append(text)
        elif not text.strip(WHITESPACE):
            self.segment_ws += text
        else:
            self.out.content.append(self.segment_ws + text)
            self.segment_ws, self.segment_has_text = "", True

    def _new_call(self) -> CallScanner:
        limit = self.rules.max_calls
        emit = limit is None or self.count < limit
        return CallScanner(self.rules, self.out, self.count, emit=emit)

    def _step(self, call: CallScanner, c: str) -> Step:
        """Feed the open call; count it once it is committed (the text before it ends)."""
        committed = call.committed
        step = call.feed(c)
        if call.committed and not committed:
            self.count += 1
            self.segment_ws, self.segment_has_text = "", False
        return step

    def _char(self, c: str) -> str | None:
        """Take one character; returns text to go through again before the rest, if any."""
        raise NotImplementedError

    def _flush(self) -> str | None:
        """At the end: settle what is held; returns text to go through again, if any."""
        raise NotImplementedError


class _Hermes(CallStream):
    """``<tool_call>`` blocks among text. States: start (text), call, close."""

    def _char(self, c: str) -> str | None:
        if self.state == "start":
            self.held += c
            if self.held == HERMES_OPEN:
                self.state, self.call = "call", self._new_call()
                return None
            while self.held and not HERMES_OPEN.startswith(self.held):
                self._text(self.held[0])
                self.held = self.held[1:]
            return None
        if self.state == "call":
            assert self.call is not None
            if not self.call.committed:  # held for a failure, which then gives it back
                self.held += c
            step = self._step(self.call, c)
            if step is Step.ENDED:
                self.state, self.held = "close", ""
            elif step is Step.FAILED:
                return self._failed(c)
            return None
        # close: whitespace and the closing tag are the call's
        self.held += c
        tail = self.held.lstrip(WHITESPACE)
        if tail == HERMES_CLOSE:
            self.state, self.held = "start", ""
        elif not HERMES_CLOSE.startswith(tail):
            self.state, again, self.held = "start", self.held, ""
            return again
        return None

    def _failed(self, c: str) -> str:
        assert self.call is not None
        self.state = "start"
        held, self.held = self.held, ""
        if self.call.committed:  # it stands; the text goes on from here
            return c
        self._text(HERMES_OPEN)
        return held[len(HERMES_OPEN) :]

    def _flush(self) -> str | None:
        if self.state == "call":
            assert self.call is not None
            if self.call.committed:
                self.state, self.held = "start", ""
                return None
            return self._failed("")
        if self.state == "close":
            self.state, again, self.held = "start", self.held, ""
            return again or None
        self._text(self.held)
        self.held = ""
        return None


class _Llama3(CallStream):
    """``{...}; {...}`` as the whole answer. States: start, call, separator, next, text."""

    def _char(self, c: str) -> str | None:
        if self.state == "text":
            self._text(c)
            return None
        if self.state == "separator":
            if c in WHITESPACE:
                self.held += c
            elif c == ";":
                self.state, self.held = "next", ""
            else:
                self._to_text(c)
            return None
        if self.state == "call":
            assert self.call is not None
            if not self.call.committed:  # held for a failure, which then gives it back
                self.held += c
            step = self._step(self.call, c)
            if step is Step.ENDED:
                self.state, self.held = "separator", ""
            elif step is Step.FAILED:
                if self.call.committed:  # it stands; the text goes on from here
                    self.held = c
                self._to_text("")
            return None
        self.held += c
        body = self.held.lstrip(WHITESPACE)
        if self.state == "start" and PYTHON_TAG.startswith(body) and body != PYTHON_TAG:
            return None
        if self.state == "start" and body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip(WHITESPACE)
        if not body:
            return None
        if body == "{":
            self.state, self.call = "call", self._new_call()
            self._step(self.call, "{")
        else:
            self._to_text("")
        return None

    def _to_text(self, c: str) -> None:
        """Everything from here on is content, the text held back first."""
        self.state = "text"
        self._text(self.held + c)
        self.held = ""

    def _flush(self) -> str | None:
        committed = self.state == "call" and self.call is not None and self.call.committed
        if self.state != "text" and not committed:
            self._text(self.held)
        self.held = ""
        return None


class _Required(CallStream):
    """A guided JSON array of calls: no content. States: start, next, call, separator, end."""

    def _char(self, c: str) -> str | None:
        if self.state == "call":
            assert self.call is not None
            step = self._step(self.call, c)
            if step is Step.ENDED:
                self.state = "separator"
            elif step is Step.FAILED:
                self.state = "end"
            return None
        if c in WHITESPACE or self.state == "end":
            return None
        expected = {"start": "[", "next": "{", "separator": ","}[self.state]
        if c != expected:
            self.state = "end"
        elif c == "{":
            self.state, self.call = "call", self._new_call()
            self._step(self.call, c)
        else:
            self.state = "next"
        return None

    def _flush(self) -> str | None:
        return None


class _Named(CallStream):
    """A guided JSON object: the named function's arguments. States: start, value, all, end."""

    def __init__(self, rules: CallRules) -> None:
        super().__init__(rules)
        self.count = 1
        self.escaper = ControlEscaper()
        self.scan = JsonValue()
        self.out.start(0, new_call_id(), rules.named)

    def _char(self, c: str) -> str | None:
        if self.state == "end" or (self.state == "start" and c in WHITESPACE):
            return None
        if self.state != "all":
            self.state = "value"
            step = self.scan.feed(c)
            if step is Step.BEFORE:
                self.state = "end"
                return None
            if step is Step.ENDED:
                self.state = "end"
            elif step is Step.FAILED:
                self.state = "all"  # not JSON after all: the rest is sent as it is
        self.out.arguments(0, self.escaper.feed(c))
        return None

    def _flush(self) -> str | None:
        return None


def call_stream(rules: CallRules) -> CallStream:
    """The stream parser of ``rules.syntax``."""
    kinds: dict[CallSyntax, type[CallStream]] = {
        CallSyntax.HERMES: _Hermes,
        CallSyntax.LLAMA3_JSON: _Llama3,
        CallSyntax.REQUIRED: _Required,
        CallSyntax.NAMED: _Named,
    }
    return kinds[rules.syntax](rules)
