"""The gateway's pieces without a cluster: chat templates against ``transformers``, request
parsing, the router-field -> OpenAI-parameter mapping, and how choices are planned."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest

from pdserve.client import InvalidRequest, Overloaded, ServerError, Unavailable
from pdserve.errors import InvalidArgumentError, ModelLoadError
from pdserve.gateway import FALLBACK_TEMPLATE, ChatTemplate
from pdserve.gateway.body import param_of
from pdserve.gateway.errors import from_client_error, openai_param
from pdserve.gateway.fields import refusals
from pdserve.gateway.generation import plan_jobs
from pdserve.gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from pdserve.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Où est la mer?"},
    {"role": "assistant", "content": "Là-bas."},
    {"role": "user", "content": "Merci"},
]


def _messages() -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in CONVERSATION]


@pytest.mark.parametrize("family_dir", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_tokens_match_transformers(
    family_dir: str, add_generation_prompt: bool, request: pytest.FixtureRequest
) -> None:
    from transformers import AutoTokenizer

    model_dir: Path = request.getfixturevalue(family_dir)
    text = ChatTemplate.from_dir(model_dir).render(
        _messages(), add_generation_prompt=add_generation_prompt
    )
    ours = Tokenizer.from_dir(model_dir).encode(text, add_bos=False)
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    expected_text = hf.apply_chat_template(
        CONVERSATION, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    expected = hf(expected_text, add_special_tokens=False)["input_ids"]
    assert text == expected_text
    assert ours == expected


def test_fallback_is_chatml_when_the_checkpoint_has_none(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "no-template"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_dir(model)
    assert template.source == FALLBACK_TEMPLATE
    assert template.render(_messages()[:2]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nOù est la mer?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_file_and_named_templates(tiny_llama_dir: Path, tmp_path: Path) -> None:
    override = tmp_path / "t.jinja"
    override.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    rendered = ChatTemplate.from_dir(tiny_llama_dir, override).render(_messages()[:1])
    assert rendered == "[system]Be brief."

    model = tmp_path / "named"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ messages[0].content | upper }}"},
    ]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_dir(model).render(_messages()) == "BE BRIEF."
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="default"):
        ChatTemplate.from_dir(model)


def test_template_refusal_names_messages(tmp_path: Path, tiny_llama_dir: Path) -> None:
    strict = tmp_path / "strict.jinja"
    strict.write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}ok"
    )
    with pytest.raises(InvalidArgumentError) as err:
        ChatTemplate.from_dir(tiny_llama_dir, strict).render(_messages())
    assert err.value.field == "messages" and "first must be user" in str(err.value)


def test_template_is_sandboxed(tmp_path: Path, tiny_llama_dir: Path) -> None:
    evil = tmp_path / "evil.jinja"
    evil.write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidArgumentError, match="messages"):
        ChatTemplate.from_dir(tiny_llama_dir, evil).render(_messages())


def test_prompt_forms() -> None:
    def prompts(value: object) -> list[str | list[int]]:
        return CompletionRequest.model_validate({"prompt": value}).prompts()

    assert prompts("hi") == ["hi"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    assert prompts([]) == []


def test_unsupported_parameters_are_named() -> None:
    body = CompletionRequest.model_validate(
        {"prompt": "x", "logprobs": 21, "echo": True, "best_of": 2, "suffix": "y"}
    )
    assert [p for p, _ in refusals(body)] == ["best_of", "logprobs", "suffix"]
    assert refusals(CompletionRequest.model_validate({"prompt": "x", "logprobs": 20})) == []
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": [{"type": "image_url"}]}],
            "response_format": {"type": "json_object"},
        }
    )
    # response_format json_object is honoured (a guide); images are not.
    assert [p for p, _ in refusals(chat)] == ["messages[0].content[0].type"]


def test_chat_max_tokens_spelling() -> None:
    def parse(extra: dict[str, int]) -> tuple[str, int | None]:
        body = {"messages": [{"role": "user", "content": "x"}], **extra}
        return ChatCompletionRequest.model_validate(body).max_tokens_param()

    assert parse({}) == ("max_tokens", None)
    assert parse({"max_tokens": 5}) == ("max_tokens", 5)
    assert parse({"max_completion_tokens": 7, "max_tokens": 5}) == ("max_completion_tokens", 7)


@pytest.mark.parametrize(
    ("field", "prompt_param", "expected"),
    [
        ("sampling.max_tokens", "prompt", "max_completion_tokens"),
        ("sampling.temperature", "prompt", "temperature"),
        ("sampling.stop_token_ids", "prompt", "stop_token_ids"),
        ("text", "prompt", "prompt"),
        ("token_ids", "messages", "messages"),
        ("token_ids[2]", "prompt", "prompt"),
        ("request_id", "prompt", "request_id"),
        (None, "prompt", None),
    ],
)
def test_router_fields_map_to_openai_params(
    field: str | None, prompt_param: str, expected: str | None
) -> None:
    got = openai_param(field, prompt_param=prompt_param, max_tokens_param="max_completion_tokens")
    assert got == expected


def test_client_errors_get_http_statuses() -> None:
    bad = from_client_error(
        InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1]"),
        prompt_param="prompt",
    )
    assert (bad.status.http, bad.param, bad.message) == (400, "top_p", "top_p: must be in (0, 1]")
    assert bad.body().model_dump()["error"]["type"] == "invalid_request_error"
    cases = [
        (Overloaded(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"), 429),
        (Unavailable(grpc.StatusCode.UNAVAILABLE, "gone"), 503),
        (ServerError(grpc.StatusCode.DEADLINE_EXCEEDED, "late"), 504),
        (ServerError(grpc.StatusCode.INTERNAL, "boom"), 500),
    ]
    for err, status in cases:
        mapped = from_client_error(err, prompt_param="prompt")
        assert mapped.status.http == status
        assert mapped.code == err.code.name.lower() and mapped.param is None


def test_validation_locations_become_params() -> None:
    assert param_of(("body", "messages", 0, "role")) == "messages[0].role"
    assert param_of(("body", "prompt", "list[int]", 0)) == "prompt"
    assert param_of(("body", "prompt", "str")) == "prompt"
    assert param_of(("body",)) is None


def test_plan_jobs_numbers_choices_and_spreads_seeds() -> None:
    jobs = plan_jobs(["a", [5, 6]], 2, {"seed": 10, "max_tokens": 3}, "cmpl-x")
    assert [(j.index, j.prompt) for j in jobs] == [(0, "a"), (1, "a"), (2, [5, 6]), (3, [5, 6])]
    assert [j.options.get("seed") for j in jobs] == [10, 11, 10, 11]
    assert [j.options.get("request_id") for j in jobs] == [f"cmpl-x-{i}" for i in range(4)]
    assert all(j.options.get("max_tokens") == 3 for j in jobs)
    unseeded = plan_jobs(["a"], 3, {}, "r")
    assert all("seed" not in j.options for j in unseeded)
