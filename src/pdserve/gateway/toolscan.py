"""One tool call's JSON object read character by character, for ``toolstream``.

``CallScanner`` takes the characters after a call's opening (``<tool_call>``, or where a
``{`` may begin one) and says, at each, whether the object goes on, has ended, or cannot be
a call (``Step``). Keys, the name and every value but the arguments are checked whole with
``json.loads`` as each ends, so the scanner refuses exactly what the whole answer's parse
(``toolparse``) refuses, up to the point where it commits the call: when its name is known to
be one of the request's functions and its arguments begin (or the object ends). From there
the arguments are sent as they come (``DeltaOut``), and only their brackets and strings are
followed to find their end.
"""

from __future__ import annotations

import json
from enum import IntEnum

from pdserve.gateway.responses import ChatDelta, FunctionCallDelta, ToolCallDelta
from pdserve.gateway.toolparse import (
    ARGUMENT_KEYS,
    WHITESPACE,
    CallRules,
    ControlEscaper,
    new_call_id,
)

_CLOSES = {"{": "}", "[": "]"}


class Step(IntEnum):
    GOING = 0
    ENDED = 1
    """The value (or the call) ends with this character."""
    BEFORE = 2
    """The value (a number or a literal) ended before this character."""
    FAILED = 3


class JsonValue:
    """Where a JSON value that starts with the first character fed ends: strings, escapes
    and brackets are followed; the rest is checked once the value is whole (``json.loads``)."""

    __slots__ = ("escaped", "scalar", "stack", "started", "string")

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.started = self.string = self.escaped = self.scalar = False

    def feed(self, c: str) -> Step:
        if not self.started:
            self.started = True
            if c in WHITESPACE or c in ",:}]":
                return Step.FAILED
            self.string = c == '"'
            self.scalar = c not in '"{['
            if c in _CLOSES:
                self.stack.append(c)
            return Step.GOING
        if self.scalar:
            return Step.BEFORE if c in WHITESPACE or c in ",:}]" else Step.GOING
        if self.string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.string = False
                return Step.GOING if self.stack else Step.ENDED
            return Step.GOING
        if c == '"':
            self.string = True
        elif c in _CLOSES:
            self.stack.append(c)
        elif c in "}]":
            if not self.stack or _CLOSES[self.stack.pop()] != c:
                return Step.FAILED
            if not self.stack:
                return Step.ENDED
        return Step.GOING


class DeltaOut:
    """What one ``feed`` sends: content, and pieces of calls by index."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: list[tuple[int, str | None, str | None, list[str]]] = []
        """(index, id, name, argument pieces); id and name on a call's first piece only."""

    def start(self, index: int, call_id: str, name: str) -> None:
        self.calls.append((index, call_id, name, []))

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        if not self.calls or self.calls[-1][0] != index:
            self.calls.append((index, None, None, []))
        self.calls[-1][3].append(text)

    def take(self) -> ChatDelta:
        """The delta of what was put since the last ``take``."""
        calls = [
            ToolCallDelta(
                index=index,
                id=call_id,
                type="function" if call_id else None,
                function=FunctionCallDelta(name=name, arguments="".join(pieces)),
            )
            for index, call_id, name, pieces in self.calls
        ]
        delta = ChatDelta(content="".join(self.content) or None, tool_calls=calls or None)
        self.content, self.calls = [], []
        return delta


class CallScanner:
    """One call's JSON object, character by character. It is committed (its first piece
    sent) once its name is a known function and its arguments begin, or when the object ends
    with a name; before that a failure sends nothing, after it the call stands as sent."""

    def __init__(self, rules: CallRules, out: DeltaOut, index: int, *, emit: bool) -> None:
        self.names = rules.names
        self.out = out
        self.index = index
        self.emit = emit
        self.state = "open"
        self.key = ""
        self.value = ""
        self.scan = JsonValue()
        self.name: str | None = None
        self.arguments: str | None = None
        """Whole arguments read before the name was known."""
        self.in_arguments = False
        self.seen_arguments = False
        self.committed = False
        self.escaper = ControlEscaper()

    def _commit(self, name: str, arguments: str) -> None:
        self.committed = True
        if self.emit:
            self.out.start(self.index, new_call_id(), name)
            self.out.arguments(self.index, self.escaper.feed(arguments))

    def feed(self, c: str) -> Step:
        state = self.state
        if state in ("key_text", "value"):
            return self._in_value(c)
        if c in WHITESPACE:
            return Step.GOING
        if state == "open":
            self.state = "first_key"
            return Step.GOING if c == "{" else Step.FAILED
        if state in ("first_key", "key"):
            if c == "}" and state == "first_key":
                return self._end()
            self.state = "key_text"
            self.scan, self.value = JsonValue(), ""
            return self._in_value(c) if c == '"' else Step.FAILED
        if state == "colon":
            self.state = "value_start"
            return Step.GOING if c == ":" else Step.FAILED
        if state == "after":
            if c == ",":
                self.state = "key"
                return Step.GOING
            return self._end() if c == "}" else Step.FAILED
        # value_start
        if self.key == "name" and self.name is not None:
            return Step.FAILED
        if self.key in ARGUMENT_KEYS:
            if self.seen_arguments or c != "{":
                return Step.FAILED
            self.seen_arguments = self.in_arguments = True
            if self.name is not None:
                self._commit(self.name, "")
        self.state = "value"
        self.scan, self.value = JsonValue(), ""
        return self._in_value(c)

    def _in_value(self, c: str) -> Step:
        step = self.scan.feed(c)
        if step is Step.FAILED:
            return step
        if step is Step.BEFORE:
            if not self._value_done():
                return Step.FAILED
            return self.feed(c)
        if not (self.in_arguments and self.committed):  # sent as they come, never checked
            self.value += c
        elif self.emit:
            self.out.arguments(self.index, self.escaper.feed(c))
        if step is Step.ENDED:
            return Step.GOING if self._value_done() else Step.FAILED
        return Step.GOING

    def _value_done(self) -> bool:
        """A key or value is whole: check it, and take it."""
        text, self.value = self.value, ""
        if self.state == "key_text":
            self.state = "colon"
            try:
                self.key = json.loads(text, strict=False)
            except ValueError:
                return False
            return True
        self.state = "after"
        if self.in_arguments:
            self.in_arguments = False
            if self.committed:
                return True
            try:
                if not isinstance(json.loads(text, strict=False), dict):
                    return False
            except (ValueError, RecursionError):
                return False
            self.arguments = text
            return True
        try:
            value = json.loads(text, strict=False)
        except (ValueError, RecursionError):
            return False
        if self.key == "name":
            if not isinstance(value, str) or value not in self.names:
                return False
            self.name = value
            if self.arguments is not None:
                self._commit(value, self.arguments)
        return True

    def _end(self) -> Step:
        if self.name is None:
            return Step.FAILED
        if not self.committed:
            self._commit(self.name, self.arguments or "{}")
        self.state = "done"
        return Step.ENDED
