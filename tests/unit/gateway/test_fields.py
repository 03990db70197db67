"""Nothing silently ignored: every field of OpenAI's and vLLM's request schemas for completions
and chat completions, sent to the gateway's app in front of a router stand-in, is honoured
(it reaches the gRPC request, or shows in the response) or refused with a 400 naming it; a
field outside the schemas is refused by name unless ``--allow-unknown-fields``.

The field lists are written here from OpenAI's API reference ("Create completion", "Create
chat completion") and vLLM's OpenAI-compatible server docs (the extra parameters of both
APIs), not read from the gateway: a field the gateway forgets fails ``test_the_schemas``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.gateway.fields import NO_EFFECT
from pdserve.gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from pdserve.telemetry.metrics import GatewayMetrics
from pdserve.v1 import router_pb2
from tests.unit.gateway.stub_router import KEY
from tests.unit.gateway.test_app import CHAT, COMPLETIONS, harness, run

AUTH = {"Authorization": f"Bearer {KEY}"}

OPENAI_COMPLETIONS = [
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user",
]  # fmt: skip
OPENAI_CHAT = [
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop",
    "store", "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
    "top_p", "user", "verbosity", "web_search_options",
]  # fmt: skip
VLLM_SAMPLING = [
    "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "prompt_logprobs", "bad_words",
]  # fmt: skip
VLLM_SHARED = [
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs",
    "structural_tag", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs",
]  # fmt: skip
VLLM_COMPLETIONS = [*VLLM_SAMPLING, *VLLM_SHARED, "add_special_tokens", "prompt_embeds"]
VLLM_CHAT = [
    *VLLM_SAMPLING, *VLLM_SHARED, "echo", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs", "include_reasoning",
]  # fmt: skip
STREAM_OPTIONS = ["include_usage", "continuous_usage_stats", "include_obfuscation"]
MESSAGE = ["role", "content", "name", "tool_call_id", "tool_calls", "refusal", "audio",
           "function_call"]  # fmt: skip

TOOLS = [{"type": "function", "function": {"name": "f"}}]
Check = Callable[[Any, router_pb2.GenerateRequest], bool]
"""(the response's JSON or SSE events, the request the router got) -> the field showed."""
REFUSED = "refused"
NONE = "no effect"


def sent(name: str, value: Any) -> Check:
    """The gRPC request's ``sampling.{name}`` is ``value``."""
    return lambda _, req: getattr(req.sampling, name) == value


# field -> (its value, extra fields it needs, what shows it was honoured, or REFUSED / NONE)
SHARED: dict[str, tuple[Any, dict[str, Any], Check | str]] = {
    "temperature": (0.5, {}, sent("temperature", 0.5)),
    "top_p": (0.5, {}, sent("top_p", 0.5)),
    "n": (2, {}, lambda r, _: len(r["choices"]) == 2),
    "stream": (True, {}, lambda r, _: r[-1] == "[DONE]"),
    "stream_options": ({"include_usage": True}, {"stream": True},
                       lambda r, _: json.loads(r[-2])["usage"]["completion_tokens"] == 1),
    "stop": (["xy"], {}, sent("stop", ["xy"])),
    "seed": (7, {}, sent("seed", 7)),
    "presence_penalty": (0.5, {}, sent("presence_penalty", 0.5)),
    "frequency_penalty": (-0.5, {}, sent("frequency_penalty", -0.5)),
    "logit_bias": ({"5": 2.0, "9": -100}, {}, sent("logit_bias", {5: 2.0, 9: -100.0})),
    "user": ("someone", {}, NONE),
    "best_of": (2, {}, REFUSED),
    "use_beam_search": (True, {}, REFUSED),
    "top_k": (5, {}, sent("top_k", 5)),
    "min_p": (0.1, {}, lambda _, req: abs(req.sampling.min_p - 0.1) < 1e-9),
    "repetition_penalty": (1.25, {}, sent("repetition_penalty", 1.25)),
    "length_penalty": (0.5, {}, REFUSED),
    "stop_token_ids": ([5, 6], {}, sent("stop_token_ids", [5, 6])),
    "include_stop_str_in_output": (True, {}, REFUSED),
    "ignore_eos": (True, {}, sent("ignore_eos", True)),
    "min_tokens": (1, {}, sent("min_tokens", 1)),
    "skip_special_tokens": (False, {}, lambda _, req: not req.skip_special_tokens),
    "spaces_between_special_tokens": (False, {}, REFUSED),
    "allowed_token_ids": ([5, 6], {}, sent("allowed_token_ids", [5, 6])),
    "bad_words": (["sea"], {}, sent("bad_words", ["sea"])),
    "response_format": ({"type": "json_object"}, {}, sent("guided_json_object", True)),
    "guided_json": ({"type": "object"}, {},
                    lambda _, r: json.loads(r.sampling.guided_json) == {"type": "object"}),
    "guided_regex": ("[ab]+", {}, sent("guided_regex", "[ab]+")),
    "guided_grammar": ('root ::= "a"', {}, sent("guided_grammar", 'root ::= "a"')),
    "guided_choice": (["a", "b"], {}, lambda _, r: list(r.sampling.guided_choice) == ["a", "b"]),
    **{name: ("x", {}, REFUSED)
       for name in ("guided_decoding_backend", "guided_whitespace_pattern", "structural_tag")},
    "structured_outputs": ({"json": {}}, {}, REFUSED),
    "priority": (1, {}, REFUSED),
    "request_id": ("abc", {}, lambda r, req: r["id"].endswith("-abc")
                   and req.request_id.endswith("-abc-0")),
    "logits_processors": (["my.Processor"], {}, REFUSED),
    "return_token_ids": (True, {}, lambda r, _: r["choices"][0]["token_ids"] == [7]),
    "cache_salt": ("salt", {}, REFUSED),
    "kv_transfer_params": ({"x": 1}, {}, REFUSED),
    "vllm_xargs": ({"x": 1}, {}, REFUSED),
}  # fmt: skip

COMPLETION_ONLY: dict[str, tuple[Any, dict[str, Any], Check | str]] = {
    "prompt": ("one two", {}, lambda _, req: req.text == "one two"),
    "max_tokens": (3, {}, sent("max_tokens", 3)),
    "echo": (True, {}, lambda r, _: r["choices"][0]["text"] == "hello thereok"),
    "logprobs": (2, {}, lambda r, req: req.sampling.logprobs == 2
                 and len(r["choices"][0]["logprobs"]["top_logprobs"][0]) == 2),
    "suffix": ("end", {}, REFUSED),
    "truncate_prompt_tokens": (1, {}, lambda _, req: list(req.token_ids.ids)
                               == TOKENIZER[0].encode("hello there")[-1:]),
    "prompt_logprobs": (1, {}, lambda r, req: req.sampling.prompt_logprobs == 1
                        and r["choices"][0]["prompt_logprobs"][0] is None),
    "add_special_tokens": (False, {}, lambda _, req: req.token_ids.ids[0] != 1),
    "return_tokens_as_token_ids": (True, {"logprobs": 0}, lambda r, _:
                                   r["choices"][0]["logprobs"]["tokens"] == ["token_id:7"]),
    "prompt_embeds": ("AAAA", {}, REFUSED),
}  # fmt: skip

CHAT_ONLY: dict[str, tuple[Any, dict[str, Any], Check | str]] = {
    "messages": ([{"role": "user", "content": "zz"}], {}, lambda _, req: len(req.token_ids.ids)),
    "max_tokens": (3, {}, sent("max_tokens", 3)),
    "max_completion_tokens": (3, {}, sent("max_tokens", 3)),
    "logprobs": (True, {}, lambda r, _: r["choices"][0]["logprobs"]["content"][0]["token"]),
    "top_logprobs": (2, {"logprobs": True}, lambda r, req: req.sampling.logprobs == 2
                     and len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2),
    "audio": ({"voice": "alloy", "format": "wav"}, {}, REFUSED),
    "function_call": ("auto", {}, REFUSED),
    "functions": ([{"name": "f"}], {}, REFUSED),
    "metadata": ({"a": "b"}, {}, REFUSED),
    "modalities": (["text", "audio"], {}, REFUSED),
    "parallel_tool_calls": (False, {"tools": TOOLS, "tool_choice": "required"},
                            lambda _, req: json.loads(req.sampling.guided_json)["maxItems"] == 1),
    "prediction": ({"type": "content", "content": "x"}, {}, REFUSED),
    "prompt_cache_key": ("k", {}, NONE),
    "reasoning_effort": ("low", {}, REFUSED),
    "safety_identifier": ("s", {}, NONE),
    "service_tier": ("default", {}, lambda r, _: r["service_tier"] == "default"),
    "store": (True, {}, REFUSED),
    "tool_choice": ("required", {"tools": TOOLS}, lambda _, req: json.loads(
        req.sampling.guided_json)["items"]["anyOf"][0]["properties"]["name"] == {"const": "f"}),
    "tools": (TOOLS, {}, lambda _, req: '<tools>\n{"type": "function", "function": {"name": "f"}}'
              in _text(req)),
    "verbosity": ("low", {}, REFUSED),
    "web_search_options": ({}, {}, REFUSED),
    "truncate_prompt_tokens": (2, {}, lambda _, req: len(req.token_ids.ids) == 2),
    "prompt_logprobs": (0, {}, lambda r, req: req.sampling.prompt_logprobs == 0
                        and r["prompt_logprobs"][0] is None),
    "return_tokens_as_token_ids": (True, {"logprobs": True}, lambda r, _:
                                   r["choices"][0]["logprobs"]["content"][0]["token"]
                                   == "token_id:7"),
    "echo": (True, {}, REFUSED),
    "add_generation_prompt": (False, {}, lambda _, req: _text(req).endswith("user: hi\n")),
    "continue_final_message": (True, {"add_generation_prompt": False, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "The sea"}]},
        lambda _, req: _text(req).endswith("assistant: The sea")),
    "add_special_tokens": (True, {}, lambda _, req: req.token_ids.ids[:2] == [1, 1]),
    "documents": ([{"title": "t", "text": "DOCUMENT"}], {},
                  lambda _, req: _text(req).startswith("DOCUMENT")),
    "chat_template": ("{{ messages }}", {}, REFUSED),
    "chat_template_kwargs": ({"tail": "TAIL"}, {}, lambda _, req: _text(req).endswith("TAIL")),
    "mm_processor_kwargs": ({"x": 1}, {}, REFUSED),
    "include_reasoning": (False, {}, NONE),
}  # fmt: skip

TEMPLATE = (
    "{{ bos_token }}{% for d in documents or [] %}{{ d.text }}\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}{{ tail or '' }}"
)
"""A chat template that shows what reaches it: documents, messages, the generation prompt
and an extra variable."""
TOKENIZER: list[Any] = []


def _text(req: router_pb2.GenerateRequest) -> str:
    return str(TOKENIZER[0].decode(list(req.token_ids.ids), skip_special_tokens=True))


def test_the_schemas_are_declared_whole() -> None:
    completion = set(CompletionRequest.model_fields)
    chat = set(ChatCompletionRequest.model_fields)
    assert completion == {*OPENAI_COMPLETIONS, *VLLM_COMPLETIONS}
    assert chat == {*OPENAI_CHAT, *VLLM_CHAT}
    assert set(CompletionRequest.model_fields["stream_options"].annotation.__args__[0]  # type: ignore[union-attr]
               .model_fields) == set(STREAM_OPTIONS)  # fmt: skip
    assert set(ChatMessage.model_fields) == set(MESSAGE)
    assert completion == set(SHARED) | set(COMPLETION_ONLY) | {"model"}
    assert chat == set(SHARED) | set(CHAT_ONLY) | {"model"}
    assert {f for f, (_, _, c) in {**SHARED, **CHAT_ONLY}.items() if c == NONE} == set(NO_EFFECT)


def _events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.split("\n") if line]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_every_field_is_honoured_or_refused_by_name(
    path: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    table = {**SHARED, **(COMPLETION_ONLY if path == COMPLETIONS else CHAT_ONLY)}
    base = (
        {"prompt": "hello there", "max_tokens": 2}
        if path == COMPLETIONS
        else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )

    async def test() -> None:
        async with harness(tiny_llama_dir, chat_template=template) as h:
            TOKENIZER[:] = [h.gateway.tokenizer]
            reply = await h.http.post(path, json=base, headers=AUTH)
            assert reply.status_code == 200, reply.text
            plain = reply.json()
            for field, (value, needs, check) in table.items():
                body = {**base, **needs, field: value}
                reply = await h.http.post(path, json=body, headers=AUTH)
                if check == REFUSED:
                    assert reply.status_code == 400, (field, reply.text)
                    error = reply.json()["error"]
                    assert error["param"] == field, (field, error)
                    assert error["message"].startswith(f"{field}: ")
                    continue
                assert reply.status_code == 200, (field, reply.text)
                answer = _events(reply.text) if body.get("stream") else reply.json()
                if check == NONE:  # the same answer as without it
                    assert [c["text" if path == COMPLETIONS else "message"] for c in
                            answer["choices"]] == [c["text" if path == COMPLETIONS else "message"]
                                                   for c in plain["choices"]], field  # fmt: skip
                    assert h.stub.requests[-1].sampling == h.stub.requests[0].sampling, field
                else:
                    assert not isinstance(check, str)
                    assert check(answer, h.stub.requests[-1]), (field, answer)

    run(test)


UNKNOWN = [
    ({"frobnicate": 1}, "frobnicate"),
    ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "?"}]}, "messages[0].mood"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}]},
     "messages[0].content[0].x"),
    ({"": 1}, None),
]  # fmt: skip


@pytest.mark.parametrize(("change", "param"), UNKNOWN)
def test_unknown_fields_are_refused_unless_allowed(
    change: dict[str, Any], param: str | None, tiny_llama_dir: Path
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **change}

    async def test() -> None:
        async with harness(tiny_llama_dir) as h:
            reply = await h.http.post(CHAT, json=body, headers=AUTH)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == param and "unknown field" in error["message"]
            assert h.stub.calls["GenerateUnary"] == h.stub.calls["Generate"] == 0
        async with harness(tiny_llama_dir, allow_unknown_fields=True) as h:
            reply = await h.http.post(CHAT, json=body, headers=AUTH)
            assert reply.status_code == 200, reply.text

    run(test)


def test_a_bad_logit_bias_key_and_an_empty_allowed_list_are_named(tiny_llama_dir: Path) -> None:
    async def test() -> None:
        async with harness(tiny_llama_dir) as h:
            for change, param in [
                ({"logit_bias": {"five": 1.0}}, "logit_bias"),
                ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
                ({"allowed_token_ids": []}, "allowed_token_ids"),
                ({"logprobs": 21}, "logprobs"),
                ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                ({"stream_options": {"include_usage": True}}, "stream_options"),
            ]:
                body = {"prompt": "hi", **change}
                reply = await h.http.post(COMPLETIONS, json=body, headers=AUTH)
                assert reply.status_code == 400, (change, reply.text)
                assert reply.json()["error"]["param"] == param
            for change, param in [
                ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
                ({"top_logprobs": 2}, "top_logprobs"),
                ({"service_tier": "flex"}, "service_tier"),
            ]:
                body = {"messages": [{"role": "user", "content": "hi"}], **change}
                reply = await h.http.post(CHAT, json=body, headers=AUTH)
                assert reply.status_code == 400, (change, reply.text)
                assert reply.json()["error"]["param"] == param

    run(test)


def test_the_utility_routes(tiny_llama_dir: Path) -> None:
    """``/tokenize``, ``/detokenize``, ``/version``, ``/v1/models/{id}`` and ``/metrics``,
    each behind the key."""
    metrics = GatewayMetrics(process=False)

    async def test() -> None:
        async with harness(tiny_llama_dir, metrics=metrics) as h:
            tokenizer = h.gateway.tokenizer
            ids = tokenizer.encode("hello there")
            reply = await h.http.post("/tokenize", json={"prompt": "hello there"}, headers=AUTH)
            assert reply.json() == {"count": len(ids), "max_model_len": 8192, "tokens": ids}
            reply = await h.http.post(
                "/tokenize", headers=AUTH,
                json={"prompt": "hello there", "add_special_tokens": False,
                      "return_token_strs": True},
            )  # fmt: skip
            assert reply.json()["tokens"] == ids[1:] and len(reply.json()["token_strs"]) == len(
                ids[1:]
            )
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            reply = await h.http.post("/tokenize", json=chat, headers=AUTH)
            prepared = h.gateway.preparer.chat(json.dumps({**chat}).encode(), None)
            assert reply.json()["tokens"] == prepared.prompt_ids
            reply = await h.http.post("/detokenize", json={"tokens": ids}, headers=AUTH)
            assert reply.json() == {"prompt": tokenizer.decode(ids, False)}
            for path, body, param in [
                ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
                ("/tokenize", {"prompt": "x", "foo": 1}, "foo"),
                (
                    "/tokenize",
                    {**chat, "tools": [{"type": "function", "function": {"name": "a b"}}]},
                    "tools[0].function.name",
                ),
                ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
            ]:
                reply = await h.http.post(path, json=body, headers=AUTH)
                assert reply.status_code in (400, 404), reply.text
                assert reply.json()["error"]["param"] == param
            name = tiny_llama_dir.name
            reply = await h.http.get(f"/v1/models/{name}", headers=AUTH)
            assert reply.json()["id"] == name and reply.json()["max_model_len"] == 8192
            reply = await h.http.get("/v1/models/org/other", headers=AUTH)
            assert reply.status_code == 404
            assert reply.json()["error"]["code"] == "model_not_found"
            reply = await h.http.get("/version", headers=AUTH)
            assert reply.json() == {"version": "0.1.0"}
            reply = await h.http.get("/metrics", headers=AUTH)
            assert 'pdserve_http_requests_total{route="/version",status="200"} 1.0' in reply.text
            assert 'route="/v1/models/{model}"' in reply.text
            for method, path in [("GET", "/version"), ("GET", "/metrics"),
                                 ("GET", f"/v1/models/{name}"), ("POST", "/tokenize"),
                                 ("POST", "/detokenize")]:  # fmt: skip
                reply = await h.http.request(method, path, json={"tokens": [1]})
                assert reply.status_code == 401, (path, reply.text)

    run(test)


def test_every_stream_option_is_honoured_or_refused(tiny_llama_dir: Path) -> None:
    async def test() -> None:
        async with harness(tiny_llama_dir) as h:
            base = {"prompt": "hello there", "stream": True}
            refused = {"stream_options": {"include_obfuscation": True}}
            reply = await h.http.post(COMPLETIONS, json={**base, **refused}, headers=AUTH)
            assert reply.json()["error"]["param"] == "stream_options.include_obfuscation"
            for options in ({"include_usage": True}, {"continuous_usage_stats": True}):
                body = {**base, "stream_options": options}
                reply = await h.http.post(COMPLETIONS, json=body, headers=AUTH)
                chunks = [json.loads(e) for e in _events(reply.text)[:-1]]
                if "include_usage" in options:  # one more chunk, with the usage alone
                    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]
                else:  # the usage on every chunk (here: the stand-in's one)
                    prompt = len(h.gateway.tokenizer.encode("hello there"))
                    assert [c["usage"]["prompt_tokens"] for c in chunks] == [prompt]
                    assert list(h.stub.requests[-1].token_ids.ids)  # tokenized to count

    run(test)
