"""A request body's bytes -> a request model or a 400 naming the parameter: JSON, lone
surrogates wherever a string may be, a type error named by its parameter, and the bounds on
values and containers (the C parser and the Python scanner agree)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.gateway import body as body_module
from pdserve.gateway.body import BODY_CODE, MAX_CONTAINERS, parse_body, parse_json
from pdserve.gateway.errors import GatewayError
from pdserve.gateway.protocol import ChatCompletionRequest, CompletionRequest

BIG = 1_000_000
LONE = "\ud800"


def refusal(raw: bytes, model: type[Any] = CompletionRequest, values: int = BIG) -> GatewayError:
    with pytest.raises(GatewayError) as err:
        parse_body(raw, model, values)
    assert err.value.status.http == 400
    assert err.value.status.type == "invalid_request_error"
    return err.value


def encoded(value: dict[str, Any]) -> bytes:
    """JSON as a client writes it: a lone surrogate becomes the escape ``\\ud800``."""
    return json.dumps(value).encode()


CHAT = {"messages": [{"role": "user", "content": "hi"}]}

SURROGATES = [
    ({"prompt": LONE}, CompletionRequest, "prompt"),
    ({"prompt": ["ok", f"a{LONE}b"]}, CompletionRequest, "prompt[1]"),
    ({"prompt": "x", "stop": LONE}, CompletionRequest, "stop"),
    ({"prompt": "x", "stop": ["a", LONE]}, CompletionRequest, "stop[1]"),
    ({"prompt": "x", "user": LONE}, CompletionRequest, "user"),
    ({"prompt": "x", "model": LONE}, CompletionRequest, "model"),
    ({"prompt": "x", "suffix": "\udfff"}, CompletionRequest, "suffix"),
    ({"messages": [{"role": "user", "content": LONE}]}, ChatCompletionRequest,
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "name": LONE}]},
     ChatCompletionRequest, "messages[1].name"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     ChatCompletionRequest, "messages[0].content[0].text"),
    ({**CHAT, "chat_template_kwargs": {"x": [LONE]}}, ChatCompletionRequest,
     "chat_template_kwargs.x[0]"),
    ({**CHAT, "logit_bias": {LONE: 1}}, ChatCompletionRequest, "logit_bias"),
    ({"prompt": "x", LONE: 1}, CompletionRequest, None),
    ({"prompt": "x", "": LONE}, CompletionRequest, None),
]  # fmt: skip


@pytest.mark.parametrize(("value", "model", "param"), SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_where_it_is(
    value: dict[str, Any], model: type[Any], param: str | None
) -> None:
    err = refusal(encoded(value), model)
    assert err.param == param
    assert err.code == (BODY_CODE if param is None else "invalid_value")
    assert "lone surrogate" in err.message
    # The answer itself must be encodable: no surrogate is echoed back.
    err.body().model_dump_json().encode("utf-8")


def test_surrogate_pairs_and_other_edges_are_text() -> None:
    for text in ("🙂", "\x00", "\u202eRTL", "\ufeff", "東京", "\U0010ffff", "é" * 5000):
        assert parse_body(encoded({"prompt": text}), CompletionRequest, BIG).prompt == text
    # A pair of surrogate escapes is one character.
    assert parse_body(b'{"prompt": "\\ud83d\\ude42"}', CompletionRequest, BIG).prompt == "🙂"
    # An escaped backslash before "ud800" is no escape: nothing to refuse.
    assert parse_body(b'{"prompt": "\\\\ud800"}', CompletionRequest, BIG).prompt == "\\ud800"


@pytest.mark.parametrize(
    "raw",
    [b"\xff{}", b'{"prompt": "\xed\xa0\x80"}', b"{", b"", b'{"prompt": NaN}',
     b'{"prompt": "x", "temperature": Infinity}', b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",
     b"[" * 100_000 + b"]" * 100_000, b"\xef\xbb\xbf{}", b"[]", b'"x"', b"1", b"null"],
)  # fmt: skip
def test_a_body_that_is_no_json_object_is_a_400(raw: bytes) -> None:
    err = refusal(raw)
    assert (err.param, err.code) == (None, BODY_CODE)


def test_a_type_error_names_its_parameter() -> None:
    named = [
        ({"max_tokens": True}, "max_tokens"),
        ({"prompt": [1, True]}, "prompt"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids[1]"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ]
    for change, param in named:
        err = refusal(encoded({"prompt": "x", **change}))
        assert err.param == param and err.message.startswith(f"{param}: ")
    err = refusal(encoded({"prompt": {"a": 1}}))
    assert err.message == "prompt: must be one of str, list[int], list[str], list[list[int]]"
    chat = {"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}
    err = refusal(encoded(chat), ChatCompletionRequest)
    assert err.param == "messages[1].role"


def test_the_value_bound_holds_on_both_parsers() -> None:
    ids = list(range(1000))
    raw = encoded({"prompt": ids})
    assert parse_body(raw, CompletionRequest, 1001).prompt == ids  # fast: <= FAST_VALUES
    err = refusal(raw, values=999)
    assert (err.param, err.code) == (None, BODY_CODE) and "more than 999" in err.message
    # Past FAST_VALUES the Python scanner reads it: the same value, the same bounds.
    many = list(range(body_module.FAST_VALUES + 10))
    raw = encoded({"prompt": many, "stop": ["a", "b"], "x": {"y": [None, True, 1.5]}})
    assert parse_json(raw, BIG) == json.loads(raw)
    assert "more than" in refusal(raw, values=body_module.FAST_VALUES).message
    constants = encoded({"prompt": "x", "y": [None] * (body_module.FAST_VALUES + 10)})
    assert "more than" in refusal(constants, values=body_module.FAST_VALUES).message


def test_objects_and_arrays_are_bounded() -> None:
    raw = encoded({"prompt": "x", "y": [[]] * (MAX_CONTAINERS + 1)})
    err = refusal(raw)
    assert f"more than {MAX_CONTAINERS} JSON objects and arrays" in err.message
    # Brackets inside strings are no containers: a text full of them is read (slowly) whole.
    text = "{[" * MAX_CONTAINERS
    assert parse_body(encoded({"prompt": text}), CompletionRequest, BIG).prompt == text
