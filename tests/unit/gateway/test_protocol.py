"""The request models' types are JSON's, strictly: a boolean is no integer, a string no
number, an integer is a number; a chat role is one the gateway knows."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.gateway.protocol import ROLES, ChatCompletionRequest, CompletionRequest

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def refused_at(model: type[Any], body: dict[str, Any]) -> tuple[int | str, ...]:
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    return tuple(err.value.errors()[0]["loc"])


STRICT = [
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 1.0}, "max_tokens"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"n": True}, "n"),
    ({"seed": False}, "seed"),
    ({"top_k": "5"}, "top_k"),
    ({"logprobs": True}, "logprobs"),
    ({"temperature": True}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": [1]}, "top_p"),
    ({"stream": 1}, "stream"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop_token_ids": [1, True]}, "stop_token_ids"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"stream_options": {"include_usage": 1}}, "stream_options"),
]


@pytest.mark.parametrize(("change", "field"), STRICT)
def test_completion_types_are_strict(change: dict[str, Any], field: str) -> None:
    assert refused_at(CompletionRequest, {"prompt": "x", **change})[0] == field


CHAT_STRICT = [("max_tokens", True), ("top_logprobs", True), ("max_completion_tokens", False),
               ("n", 1.5), ("logprobs", 1), ("add_generation_prompt", 0)]  # fmt: skip


@pytest.mark.parametrize(("field", "value"), CHAT_STRICT)
def test_chat_types_are_strict(field: str, value: Any) -> None:
    assert refused_at(ChatCompletionRequest, {**CHAT, field: value})[0] == field


def test_integers_are_numbers() -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "top_p": 1})
    assert (body.temperature, body.top_p) == (1.0, 1.0)


def test_a_role_is_one_of_the_known_ones() -> None:
    assert ROLES == ("system", "user", "assistant", "tool", "developer")
    for role in ROLES:
        ChatCompletionRequest.model_validate({"messages": [{"role": role, "content": "x"}]})
    for role in ("robot", "function", "", "USER", 1, None):
        messages = [{"role": "user", "content": "x"}, {"role": role, "content": "y"}]
        with pytest.raises(ValidationError) as err:
            ChatCompletionRequest.model_validate({"messages": messages})
        first = err.value.errors()[0]
        assert tuple(first["loc"]) == ("messages", 1, "role")
        assert all(repr(r) in first["msg"] for r in ROLES), first["msg"]
