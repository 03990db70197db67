"""The tool-call parsers: a whole answer (``toolparse.parse``) and a stream (``toolstream``).

Fixed answers of each format give the calls and content written here by hand; the stream,
fed the same answer a character at a time, in pieces of 2, 3 and 7 and whole, must
reassemble (as OpenAI's clients do: content joined, each call's arguments joined by index)
to exactly the whole answer's result, in the shape OpenAI streams. Generated answers
(hypothesis: random functions, JSON arguments of any shape written in any JSON style, text
and whitespace around them, cut at random places) hold both parsers to the calls that were
written.
"""

from __future__ import annotations

import itertools
import json
import string
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.gateway.responses import ChatDelta
from pdserve.gateway.toolparse import CallRules, CallSyntax, parse
from pdserve.gateway.toolstream import call_stream

NAMES = frozenset({"get_weather", "add", "no_args"})
HERMES = CallRules(CallSyntax.HERMES, NAMES)
LLAMA3 = CallRules(CallSyntax.LLAMA3_JSON, NAMES)
REQUIRED = CallRules(CallSyntax.REQUIRED, NAMES)
Result = tuple[str | None, list[tuple[str, str]]]

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": [2, {"c": null}]}}'


def whole(text: str, rules: CallRules) -> Result:
    """The whole answer's result (an empty content as null, as a stream's reassembles)."""
    parsed = parse(text, rules)
    return parsed.content or None, [(c.function.name, c.function.arguments) for c in parsed.calls]


def streamed(text: str, rules: CallRules, cuts: list[int]) -> Result:
    """The stream fed ``text`` cut at ``cuts``, reassembled; its shape checked on the way."""
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    reader = call_stream(rules)
    deltas = [reader.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return reassemble(deltas)


def reassemble(deltas: list[ChatDelta]) -> Result:
    content = "".join(d.content or "" for d in deltas) or None
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for piece in delta.tool_calls or []:
            if piece.index not in calls:  # a call's first piece: id, type, name, arguments
                assert piece.index == len(calls), "calls are numbered in order"
                assert piece.id is not None and piece.id.startswith("call_")
                assert piece.type == "function" and piece.function.name in NAMES
                assert piece.function.arguments is not None
                calls[piece.index] = {"name": piece.function.name, "arguments": ""}
            else:  # the next ones: more arguments only
                assert piece.id is None and piece.type is None and piece.function.name is None
                assert piece.function.arguments
            calls[piece.index]["arguments"] += piece.function.arguments
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def every_cut(text: str, rules: CallRules) -> Result:
    """The whole answer's result, which every way of streaming it gives too."""
    expected = whole(text, rules)
    for step in (1, 2, 3, 7):
        assert streamed(text, rules, list(range(step, len(text), step))) == expected, step
    assert streamed(text, rules, []) == expected
    return expected


CASES = [
    pytest.param(HERMES, f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>",
                 ("Let me check.\n", [("get_weather", '{"city": "Paris"}')]), id="text-then-call"),
    pytest.param(HERMES, f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{ADD}\n"
                 "</tool_call>\n",
                 (None, [("get_weather", '{"city": "Paris"}'),
                         ("add", '{"a": 1, "b": [2, {"c": null}]}')]), id="two-calls"),
    pytest.param(HERMES, '<tool_call>{"arguments": {"x": "y"}, "id": 3, "name": "add"}</tool_call>',
                 (None, [("add", '{"x": "y"}')]), id="arguments-first-and-another-key"),
    pytest.param(HERMES, '<tool_call>{"name": "no_args"}</tool_call>', (None, [("no_args", "{}")]),
                 id="no-arguments"),
    pytest.param(HERMES, f"<tool_call>{WEATHER}", (None, [("get_weather", '{"city": "Paris"}')]),
                 id="no-closing-tag"),
    pytest.param(HERMES, f"<tool_call>{WEATHER}</tool_call> Done.",
                 (" Done.", [("get_weather", '{"city": "Paris"}')]), id="text-after"),
    pytest.param(HERMES, '<tool_call>{"name": "add", "arguments": {"s": "}</tool_call> {\\""}}'
                 "</tool_call>", (None, [("add", '{"s": "}</tool_call> {\\""}')]),
                 id="tags-and-braces-in-a-string"),
    pytest.param(HERMES, '<tool_call>{"name": "add", "arguments": {"s": "a\x1bb\tc"}}</tool_call>',
                 (None, [("add", '{"s": "a\\u001bb\\u0009c"}')]), id="raw-control-characters"),
    pytest.param(HERMES, '<tool_call>{"name": "send", "arguments": {}}</tool_call>',
                 ('<tool_call>{"name": "send", "arguments": {}}</tool_call>', []),
                 id="unknown-function"),
    pytest.param(HERMES, '<tool_call>{"arguments": {"a": }, "name": "add"}</tool_call>',
                 ('<tool_call>{"arguments": {"a": }, "name": "add"}</tool_call>', []),
                 id="bad-json"),
    pytest.param(HERMES, '<tool_call>{"name": "add", "name": "add"}',
                 ('<tool_call>{"name": "add", "name": "add"}', []), id="name-twice"),
    pytest.param(HERMES, '<tool_call>{"name": "add", "arguments": "{}"}',
                 ('<tool_call>{"name": "add", "arguments": "{}"}', []), id="arguments-as-text"),
    pytest.param(HERMES, '<tool_call>{"name": "add", "x": [1,], "arguments": {}}',
                 ('<tool_call>{"name": "add", "x": [1,], "arguments": {}}', []),
                 id="bad-json-before-the-arguments"),
    pytest.param(HERMES, f"a <tool_ b <tool_call> oops <tool_call>{WEATHER}",
                 ("a <tool_ b <tool_call> oops ", [("get_weather", '{"city": "Paris"}')]),
                 id="tags-that-are-text"),
    pytest.param(HERMES, "Just text.\n", ("Just text.\n", []), id="text"),
    pytest.param(HERMES, " \n", (" \n", []), id="whitespace"),
    pytest.param(CallRules(CallSyntax.HERMES, NAMES, max_calls=1),
                 f"<tool_call>{WEATHER}</tool_call> <tool_call>{ADD}</tool_call> bye",
                 (" bye", [("get_weather", '{"city": "Paris"}')]), id="one-call-at-most"),
    pytest.param(LLAMA3, '<|python_tag|>{"name": "add", "parameters": {"a": 1}}',
                 (None, [("add", '{"a": 1}')]), id="llama3-python-tag"),
    pytest.param(LLAMA3, ' {"name": "add", "parameters": {"a": 1}} ;\n{"name": "get_weather", '
                 '"parameters": {"city": "Oslo"}}', (None, [("add", '{"a": 1}'),
                 ("get_weather", '{"city": "Oslo"}')]), id="llama3-two-calls"),
    pytest.param(LLAMA3, '{"name": "add", "parameters": {"a": 1}} and more',
                 (" and more", [("add", '{"a": 1}')]), id="llama3-text-after"),
    pytest.param(LLAMA3, '{"name": "add", "parameters": {"a": 1}}; {"name": "x"}',
                 (' {"name": "x"}', [("add", '{"a": 1}')]), id="llama3-second-is-no-call"),
    pytest.param(LLAMA3, 'Sure: {"name": "add", "parameters": {}}',
                 ('Sure: {"name": "add", "parameters": {}}', []), id="llama3-text-first"),
    pytest.param(LLAMA3, '{"name": "nope", "parameters": {}}',
                 ('{"name": "nope", "parameters": {}}', []), id="llama3-unknown-function"),
    pytest.param(REQUIRED, ' [{"name": "add", "parameters": {"a": 1}},\n {"name": "no_args", '
                 '"parameters": {}} ]', (None, [("add", '{"a": 1}'), ("no_args", "{}")]),
                 id="required"),
    pytest.param(CallRules(CallSyntax.NAMED, NAMES, named="add"), ' {"a": [1, "}"]}',
                 (None, [("add", '{"a": [1, "}"]}')]), id="named"),
]  # fmt: skip


@pytest.mark.parametrize(("rules", "text", "expected"), CASES)
def test_answers_parse_alike_whole_and_streamed(
    rules: CallRules, text: str, expected: Result
) -> None:
    assert every_cut(text, rules) == expected
    for _, arguments in expected[1]:  # a strict parser reads every call's arguments
        assert isinstance(json.loads(arguments), dict)


def test_a_named_answer_cut_short_is_what_came() -> None:
    named = CallRules(CallSyntax.NAMED, NAMES, named="add")
    assert every_cut('{"a": "cut sh', named) == (None, [("add", '{"a": "cut sh')])


def test_a_stream_holds_back_only_what_may_begin_a_call() -> None:
    reader = call_stream(HERMES)
    assert reader.feed("Hi <tool_").content == "Hi "
    assert reader.feed("x").content == "<tool_x"  # not a tag after all: sent at once
    first = reader.feed(' <tool_call>{"name": "add", "arguments": {"a"')
    assert first.content == " "
    assert first.tool_calls is not None and len(first.tool_calls) == 1
    call = first.tool_calls[0]
    assert (call.index, call.type, call.function.name) == (0, "function", "add")
    assert call.function.arguments == '{"a"'  # the arguments begin with the call's first piece
    more = reader.feed(": 1}}")
    assert more.tool_calls is not None and more.tool_calls[0].function.arguments == ": 1}"
    assert more.tool_calls[0].id is None and more.content is None
    last = reader.feed("</tool_call>", final=True)
    assert last.content is None and last.tool_calls is None
    assert reader.calls == 1


def test_a_stream_cannot_take_back_a_call_it_began() -> None:
    """What ``toolstream`` says: arguments cut short, or not JSON, stand as sent, where the
    whole answer's parse gives the text as content."""
    for text, sent in [
        ('<tool_call>{"name": "add", "arguments": {"a": 1', '{"a": 1'),
        ('<tool_call>{"name": "add", "arguments": {"a": }}</tool_call>', '{"a": }'),
    ]:
        assert whole(text, HERMES) == (text, [])
        assert streamed(text, HERMES, [5]) == (None, [("add", sent)])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
WS = st.text(alphabet=" \n\t", max_size=3)
TEXT = st.text(alphabet=string.ascii_letters + ' \n<>{}[];"_:,', max_size=12)


@st.composite
def a_call(draw: st.DrawFn, llama3: bool) -> tuple[str, str, str]:
    """(function, its arguments' JSON text, the call's JSON text), in any JSON style."""
    name = draw(st.sampled_from(sorted(NAMES)))
    arguments = draw(st.dictionaries(st.text(), JSON, max_size=4))
    style = draw(st.sampled_from([{}, {"indent": 2}, {"separators": (",", ":")}]))
    ascii_only = draw(st.booleans())
    args = json.dumps(arguments, ensure_ascii=ascii_only, **style)
    key = "parameters" if llama3 else draw(st.sampled_from(["arguments", "parameters"]))
    parts = [f'"name":{draw(WS)}{json.dumps(name)}', f'"{key}":{draw(WS)}{args}']
    if draw(st.booleans()):
        parts.reverse()
    if draw(st.booleans()):
        parts.insert(1, f'"id": {json.dumps(draw(JSON))}')
    return name, args, "{" + draw(WS) + f"{draw(WS)},{draw(WS)}".join(parts) + draw(WS) + "}"


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_generated_hermes_answers(data: st.DataObject) -> None:
    calls = data.draw(st.lists(a_call(False), max_size=3))
    texts = data.draw(st.lists(TEXT, min_size=len(calls) + 1, max_size=len(calls) + 1))
    answer = texts[0]
    for i, ((_, _, body), after) in enumerate(zip(calls, texts[1:], strict=True)):
        close = "</tool_call>"
        if i == len(calls) - 1 and not after:  # the tag may be missing at the end
            close = data.draw(st.sampled_from([close, ""]))
        answer += f"<tool_call>{data.draw(WS)}{body}{data.draw(WS)}{close}{after}"
    cuts = data.draw(st.lists(st.integers(0, len(answer)), max_size=8))
    expected = whole(answer, HERMES)
    assert streamed(answer, HERMES, cuts) == expected
    if "<tool_call>" not in "".join(texts):
        content = "".join(t for t in texts if t.strip(" \n\t\r")) or None
        assert expected == ((content, [(n, a) for n, a, _ in calls]) if calls
                            else (answer or None, []))  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_generated_llama3_answers(data: st.DataObject) -> None:
    calls = data.draw(st.lists(a_call(True), min_size=1, max_size=3))
    answer = data.draw(st.sampled_from(["", "<|python_tag|>"])) + data.draw(WS)
    answer += f"{data.draw(WS)};{data.draw(WS)}".join(body for _, _, body in calls)
    tail = data.draw(st.sampled_from(["", " ", " see above"]))
    cuts = data.draw(st.lists(st.integers(0, len(answer + tail)), max_size=8))
    expected = (tail if tail.strip() else None, [(n, a) for n, a, _ in calls])
    assert whole(answer + tail, LLAMA3) == expected
    assert streamed(answer + tail, LLAMA3, cuts) == expected
