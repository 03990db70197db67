"""Tool calls in a model's answer: the formats, and the parse of a whole answer.

How a chat answer holds its calls (``CallSyntax``):

* ``hermes`` (Hermes 2 Pro, Qwen2 and Qwen2.5, and the gateway's own prompt for templates
  that do not render tools): ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` blocks
  among text; the closing tag may be missing at the end;
* ``llama3_json`` (Llama 3.1 and 3.2's JSON calls): an answer that is, after an optional
  ``<|python_tag|>``, ``{"name": N, "parameters": {...}}`` objects separated by ``;``;
* ``required`` (``tool_choice: "required"``): a guided JSON array of such objects;
* ``named`` (``tool_choice`` naming a function): a guided JSON object, that function's
  arguments.

The rules, the same for a whole answer (here) and a stream (``toolstream``, which the tests
hold to the same result on every answer whose calls are well formed):

* a call is a JSON object whose ``name`` is one of the request's functions and whose
  ``arguments`` (or ``parameters``) is a JSON object, or absent (``{}``); other keys are
  ignored; a name or arguments given twice, or any JSON error, makes it no call, and its text
  stays text, as vLLM does;
* ``arguments`` is the model's own JSON text of that object, with any raw control character
  inside a string escaped (so that a strict JSON parser reads it: a guided string may hold
  one, ``docs/sampling.md``);
* ``content`` is the text outside the calls; once there is a call, a text between, before or
  after calls that is only whitespace is dropped, and an empty content is null. ``required``
  and ``named`` answers have no content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from enum import StrEnum

from pdserve.gateway.responses import FunctionCall, ToolCall

WHITESPACE = " \t\n\r"
"""JSON's whitespace."""
HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")
_CONTROL = re.compile("[\x00-\x1f]")
_DECODER = json.JSONDecoder(strict=False)


class CallSyntax(StrEnum):
    """How an answer holds its tool calls (see the module docstring)."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    REQUIRED = "required"
    NAMED = "named"


PARSERS = (CallSyntax.HERMES.value, CallSyntax.LLAMA3_JSON.value)
"""The gateway's ``--tool-call-parser`` choices (the syntax of ``tool_choice: "auto"``)."""


@dataclass(frozen=True, slots=True)
class CallRules:
    """How one choice's answer is read for calls."""

    syntax: CallSyntax
    names: frozenset[str]
    """The functions the request offers: a call of another is text."""
    max_calls: int | None = None
    """At most this many calls are taken (``parallel_tool_calls: false``: 1); later ones are
    dropped, text and all."""
    named: str = ""
    """``NAMED``: the function called."""


@dataclass(frozen=True, slots=True)
class Parsed:
    """A whole answer's content and calls."""

    content: str | None
    calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))


class ControlEscaper:
    """Escapes raw control characters inside JSON strings of a text fed piece by piece
    (``\\u001b`` for ESC); everything else passes as it is."""

    __slots__ = ("escaped", "in_string")

    def __init__(self) -> None:
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> str:
        out = []
        for c in text:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                elif c < " ":
                    c = f"\\u{ord(c):04x}"
            elif c == '"':
                self.in_string = True
            out.append(c)
        return "".join(out)


def escape_controls(json_text: str) -> str:
    """``json_text`` with raw control characters inside its strings escaped."""
    return ControlEscaper().feed(json_text) if _CONTROL.search(json_text) else json_text


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


@dataclass(frozen=True, slots=True)
class _Found:
    name: str
    arguments: str
    end: int
    """Where the call's object ends in the text."""


def _call_at(text: str, pos: int, names: frozenset[str]) -> _Found | None:
    """The call whose object starts at ``pos`` (after whitespace), or None."""
    pos = skip_ws(text, pos)
    if not text.startswith("{", pos):
        return None
    name: str | None = None
    arguments: str | None = None
    pos = skip_ws(text, pos + 1)
    if text.startswith("}", pos):
        return None
    while True:
        try:
            key, pos = _DECODER.raw_decode(text, pos)
            pos = skip_ws(text, pos)
            if not isinstance(key, str) or not text.startswith(":", pos):
                return None
            start = skip_ws(text, pos + 1)
            value, pos = _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):
            return None
        if key == "name":
            if name is not None or not isinstance(value, str):
                return None
            name = value
        elif key in ARGUMENT_KEYS:
            if arguments is not None or not isinstance(value, dict):
                return None
            arguments = text[start:pos]
        pos = skip_ws(text, pos)
        if text.startswith(",", pos):
            pos = skip_ws(text, pos + 1)
            continue
        if not text.startswith("}", pos):
            return None
        if name is None or name not in names:
            return None
        return _Found(name, escape_controls(arguments or "{}"), pos + 1)


def _content(segments: list[str]) -> str | None:
    """The text around calls: whitespace-only pieces dropped, null when nothing is left."""
    return "".join(s for s in segments if s.strip(WHITESPACE)) or None


def _hermes(text: str, names: frozenset[str]) -> tuple[list[_Found], list[str]]:
    found: list[_Found] = []
    segments: list[str] = []
    pos = start = 0
    while (at := text.find(HERMES_OPEN, pos)) >= 0:
        call = _call_at(text, at + len(HERMES_OPEN), names)
        if call is None:  # the tag is text; look past it
            pos = at + len(HERMES_OPEN)
            continue
        segments.append(text[start:at])
        found.append(call)
        end = call.end
        after = skip_ws(text, end)
        if text.startswith(HERMES_CLOSE, after):
            end = after + len(HERMES_CLOSE)
        start = pos = end
    segments.append(text[start:])
    return found, segments


def _llama3(text: str, names: frozenset[str]) -> tuple[list[_Found], list[str]]:
    pos = skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, pos):
        pos += len(PYTHON_TAG)
    found: list[_Found] = []
    while (call := _call_at(text, pos, names)) is not None:
        found.append(call)
        pos = call.end
        after = skip_ws(text, pos)
        if not text.startswith(";", after):
            break
        pos = after + 1
    return found, [text[pos:]]


def _required(text: str, names: frozenset[str]) -> list[_Found]:
    pos = skip_ws(text, 0)
    if not text.startswith("[", pos):
        return []
    found: list[_Found] = []
    pos += 1
    while (call := _call_at(text, pos, names)) is not None:
        found.append(call)
        pos = skip_ws(text, call.end)
        if not text.startswith(",", pos):
            break
        pos += 1
    return found


def named_arguments(text: str) -> str:
    """A ``named`` answer's arguments: its JSON value (leading whitespace and anything after
    the value left out), or all of it when it is not whole JSON (cut short)."""
    text = text[skip_ws(text, 0) :]
    try:
        _, end = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        end = len(text)
    return escape_controls(text[:end])


def parse(text: str, rules: CallRules) -> Parsed:
    """The content and calls of a whole answer (see the module docstring)."""
    if rules.syntax is CallSyntax.NAMED:
        return Parsed(None, [tool_call(rules.named, named_arguments(text))])
    content: str | None = None
    if rules.syntax is CallSyntax.REQUIRED:
        found = _required(text, rules.names)
    else:
        parser = _hermes if rules.syntax is CallSyntax.HERMES else _llama3
        found, segments = parser(text, rules.names)
        if not found:
            return Parsed(text, [])
        content = _content(segments)
    taken = found if rules.max_calls is None else found[: rules.max_calls]
    return Parsed(content, [tool_call(f.name, f.arguments) for f in taken])
