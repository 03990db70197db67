"""Tools on the chat endpoint, without a cluster: the request's checks (a 400 naming the field
at fault, nothing sent to the router), the tools in the prompt (a template that renders them,
against ``transformers``' ``apply_chat_template``; one that does not, with the gateway's
Hermes or Llama 3 prompt), the guides of ``tool_choice`` ``required`` and named (checked with
``jsonschema`` against calls that must and must not pass), and the answers, whole and
streamed, through the official ``openai`` client in front of a router stand-in that answers
with a tool call's text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from pdserve.gateway import FALLBACK_TEMPLATE, ChatTemplate
from pdserve.gateway.errors import GatewayError
from pdserve.gateway.protocol import ChatMessage, NamedToolChoice, ToolDefinition
from pdserve.gateway.toolparse import CallSyntax
from pdserve.gateway.tools import tool_use
from pdserve.v1 import common_pb2
from tests.unit.gateway.stub_router import KEY
from tests.unit.gateway.test_app import CHAT, harness, run

AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, ADD]
USER = {"role": "user", "content": "Weather in Paris?"}
HISTORY = [
    USER,
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]  # fmt: skip


def _tools(**fields: Any) -> Any:
    """``tool_use`` of these request fields (``tools``: ``TOOLS`` unless given)."""
    tools = [ToolDefinition.model_validate(t) for t in fields.pop("tools", TOOLS)]
    if isinstance(fields.get("tool_choice"), dict):
        fields["tool_choice"] = NamedToolChoice.model_validate(fields["tool_choice"])
    return tool_use(tools, **fields)


BAD = [
    ({"tools": [{**WEATHER, "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, {**ADD, "function": {"name": "x" * 65}}]}, "tools[1].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{**ADD, "function": {"name": "add", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
     "tools[0].function.x"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}},
      "guided_regex": "[0-9]+"}, "tool_choice"),
    ({"messages": [USER, {**HISTORY[1], "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": "Paris"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [USER, {**HISTORY[1], "tool_calls": [{"id": "c"}]}]},
     "messages[1].tool_calls[0].function"),
    ({"functions": [{"name": "f"}]}, "functions"),
]  # fmt: skip


def test_bad_tools_are_400s_naming_the_field(tiny_llama_dir: Path) -> None:
    async def test() -> None:
        async with harness(tiny_llama_dir) as h:
            for change, param in BAD:
                body = {"messages": [USER], "max_tokens": 2, **change}
                reply = await h.http.post(CHAT, json=body, headers=AUTH)
                assert reply.status_code == 400, (change, reply.text)
                error = reply.json()["error"]
                assert error["param"] == param, (change, error)
                assert error["message"].startswith(f"{param}: "), error
            assert h.stub.calls["GenerateUnary"] == h.stub.calls["Generate"] == 0

    run(test)


TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}{% continue %}{% endif %}
<|im_start|>{{ message.role }}
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
"""A template that renders tools and earlier calls, as Qwen2.5's does."""


def test_a_template_that_renders_tools_gets_them_as_transformers_gives_them(
    tiny_qwen2_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    template = ChatTemplate(TOOL_TEMPLATE, {}, "test")
    assert template.renders_tools
    messages = [ChatMessage.model_validate(m) for m in HISTORY]
    ours = template.render(messages, tools=_tools().template_tools())
    hf = AutoTokenizer.from_pretrained(str(tiny_qwen2_dir))
    history = json.loads(json.dumps(HISTORY))
    history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}  # HF's convention
    expected = hf.apply_chat_template(
        history, tools=TOOLS, chat_template=TOOL_TEMPLATE, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    assert ours == expected
    assert '"description": "The weather in a city."' in ours
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in ours
    # Without tools the variable is null, as transformers passes it.
    assert template.render(messages[:1]) == hf.apply_chat_template(
        history[:1], chat_template=TOOL_TEMPLATE, tokenize=False, add_generation_prompt=True
    )


def test_a_template_that_renders_none_gets_the_gateway_s_prompt() -> None:
    chatml = ChatTemplate(FALLBACK_TEMPLATE, {}, "fallback (ChatML)")
    assert not chatml.renders_tools
    messages = [ChatMessage.model_validate(m) for m in HISTORY]
    tools = _tools(tools=[ADD]).template_tools()
    listed = '{"type": "function", "function": {"name": "add", "parameters": {"type": "object", ' \
        '"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ' \
        '["a", "b"], "additionalProperties": false}}}'  # fmt: skip
    assert chatml.render(messages, tools=tools) == (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the "
        "user query.\n\nYou are provided with function signatures within <tools></tools> XML "
        f"tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, return a json object "
        "with function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\nSunny, 21 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    llama3 = ChatTemplate(FALLBACK_TEMPLATE, {}, "fallback", CallSyntax.LLAMA3_JSON)
    system = [ChatMessage(role="system", content="Be brief.")]
    text = llama3.render(system + messages, tools=tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nGiven the following functions")
    assert f"dictionary of argument name and its value}}. Do not use variables.\n\n{listed}" in text
    assert '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    assert "<|im_start|>tool\nSunny, 21 C<|im_end|>" in text
    assert chatml.render(messages[:1]) == "<|im_start|>user\nWeather in Paris?<|im_end|>\n" \
        "<|im_start|>assistant\n"  # fmt: skip


def test_the_guides_of_required_and_named() -> None:
    named = _tools(tool_choice={"type": "function", "function": {"name": "add"}}).guide()
    jsonschema.validate({"a": 1, "b": 2}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": 1, "c": 2}, named)

    weather = {"name": "get_weather", "parameters": {"city": "Paris"}}
    add = {"name": "add", "parameters": {"a": 1, "b": 2}}
    required = _tools(tool_choice="required").guide()
    jsonschema.Draft202012Validator.check_schema(required)
    for calls in ([weather], [add, weather, add]):
        jsonschema.validate(calls, required)
    for calls in ([], [{"name": "get_weather", "parameters": {"a": 1, "b": 2}}],
                  [{"name": "send", "parameters": {}}], [{"name": "add"}], weather):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, required)
    one = _tools(tool_choice="required", parallel_tool_calls=False).guide()
    jsonschema.validate([add], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([add, weather], one)
    assert _tools().guide() is None and _tools(tool_choice="none").guide() is None


def test_required_lifts_each_function_s_defs_to_the_top() -> None:
    place = {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}
    where = {"type": "function", "function": {"name": "where", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}}, "required": ["at"],
        "$defs": {"Place": place}}}}  # fmt: skip
    guide = _tools(tools=[where, ADD], tool_choice="required").guide()
    jsonschema.validate([{"name": "where", "parameters": {"at": {"lat": 1.5}}}], guide)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "where", "parameters": {"at": {"lat": "x"}}}], guide)
    other = json.loads(json.dumps(where))
    other["function"]["name"] = "elsewhere"
    other["function"]["parameters"]["$defs"]["Place"] = {"type": "string"}
    with pytest.raises(GatewayError) as err:
        _tools(tools=[where, other], tool_choice="required").guide()
    assert err.value.param == "tools[1].function.parameters"


REPLY = ["I'll check", ".\n<tool", '_call>\n{"name": "get_', 'weather", "argu',
         'ments": {"city": "Pa', 'ris"}}\n</tool_call>']  # fmt: skip


def test_answers_through_the_openai_client(tiny_llama_dir: Path) -> None:
    """The stand-in answers with a Hermes call in pieces: the client gets it as a tool call,
    whole and streamed (the stream accumulated by the client's own helper), and the text
    before it as content; ``tool_choice: "none"`` gets the text alone."""

    async def test() -> None:
        async with harness(tiny_llama_dir) as h:
            h.stub.reply, h.stub.finish = REPLY, common_pb2.FINISH_REASON_STOP
            oai = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=KEY,
                                     http_client=h.http, max_retries=0)  # fmt: skip
            ask: dict[str, Any] = {"model": tiny_llama_dir.name, "messages": HISTORY,
                                   "tools": TOOLS, "max_tokens": 20}  # fmt: skip
            done = await oai.chat.completions.create(**ask)
            choice = done.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "I'll check.\n"
            assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
            call = choice.message.tool_calls[0]
            assert call.type == "function" and call.id.startswith("call_")
            assert call.function.name == "get_weather"  # type: ignore[union-attr]
            assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]

            chunks = [c async for c in await oai.chat.completions.create(**ask, stream=True)]
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            assert all("<" not in (d.content or "") for d in deltas)  # no piece of a tag leaks
            firsts = [t for d in deltas for t in d.tool_calls or [] if t.id]
            assert [(t.index, t.type, t.function.name) for t in firsts] == [  # type: ignore[union-attr]
                (0, "function", "get_weather")
            ]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            async with oai.chat.completions.stream(**ask) as stream:
                final = await stream.get_final_completion()
            message = final.choices[0].message
            assert message.content == "I'll check.\n" and message.tool_calls is not None
            assert [(c.function.name, json.loads(c.function.arguments)) for c in  # type: ignore[union-attr]
                    message.tool_calls] == [("get_weather", {"city": "Paris"})]  # fmt: skip

            none = await oai.chat.completions.create(**ask, tool_choice="none")
            assert none.choices[0].message.content == "".join(REPLY)
            assert none.choices[0].message.tool_calls is None
            assert none.choices[0].finish_reason == "stop"
            prompt = h.gateway.tokenizer.decode(list(h.stub.requests[-1].token_ids.ids))
            assert "<tools>" in prompt  # rendered all the same, as vLLM does

    run(test)


def test_required_and_named_send_their_guide_and_read_the_json(tiny_llama_dir: Path) -> None:
    async def test() -> None:
        async with harness(tiny_llama_dir, tool_call_parser=CallSyntax.LLAMA3_JSON) as h:
            h.stub.finish = common_pb2.FINISH_REASON_STOP
            oai = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=KEY,
                                     http_client=h.http, max_retries=0)  # fmt: skip
            ask: dict[str, Any] = {"model": tiny_llama_dir.name, "messages": [USER],
                                   "tools": TOOLS, "max_tokens": 20}  # fmt: skip
            h.stub.reply = ['[{"name": "add", "parameters": {"a": 1, ', '"b": 2}}]']
            done = await oai.chat.completions.create(**ask, tool_choice="required")
            guide = json.loads(h.stub.requests[-1].sampling.guided_json)
            assert guide == _tools(tool_choice="required").guide()
            message = done.choices[0].message
            assert message.content is None and message.tool_calls is not None
            assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [  # type: ignore[union-attr]
                ("add", '{"a": 1, "b": 2}')
            ]
            h.stub.reply = ['{"city": ', '"Oslo"}']
            named = {"type": "function", "function": {"name": "get_weather"}}
            chunks = [c async for c in await oai.chat.completions.create(
                **ask, tool_choice=named, stream=True)]  # fmt: skip
            assert (
                json.loads(h.stub.requests[-1].sampling.guided_json)
                == WEATHER["function"]["parameters"]
            )
            pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            assert pieces[0].function.name == "get_weather" and pieces[0].id  # type: ignore[union-attr]
            assert "".join(p.function.arguments or "" for p in pieces) == '{"city": "Oslo"}'  # type: ignore[union-attr]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            prompt = h.gateway.tokenizer.decode(list(h.stub.requests[-1].token_ids.ids))
            assert "Given the following functions" in prompt  # --tool-call-parser llama3_json

    run(test)


def test_the_tool_call_parser_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from services.gateway.__main__ import parse_args

    base = ["--router", "127.0.0.1:1", "--model", "m"]
    assert parse_args(base).tool_call_parser == "hermes"
    chosen = parse_args([*base, "--tool-call-parser", "llama3_json"]).tool_call_parser
    assert CallSyntax(chosen) is CallSyntax.LLAMA3_JSON
    with pytest.raises(SystemExit):
        parse_args([*base, "--tool-call-parser", "required"])  # a tool_choice, not a parser
    assert "--tool-call-parser" in capsys.readouterr().err
