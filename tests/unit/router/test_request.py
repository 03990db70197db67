"""The router's request validation and response text, against the tiny demo tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.router import ModelLimits, prepare_request
from pdserve.router.text import ResponseText
from pdserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def limits(tiny_llama_dir: Path) -> ModelLimits:
    return ModelLimits.from_dir(tiny_llama_dir)


def _prepare(tokenizer: Tokenizer, limits: ModelLimits, **kw: object) -> object:
    args: dict[str, object] = {"text": None, "token_ids": None, "params": SamplingParams()}
    args.update(kw)
    return prepare_request(tokenizer=tokenizer, limits=limits, **args)  # type: ignore[arg-type]


def test_limits_come_from_config_json(tiny_llama_dir: Path, limits: ModelLimits) -> None:
    import json

    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    assert limits == ModelLimits(cfg["vocab_size"], cfg["max_position_embeddings"])


def test_text_is_tokenized_like_the_engine_does(tokenizer: Tokenizer, limits: ModelLimits) -> None:
    req = prepare_request(
        text="Grüße aus München", token_ids=None, params=SamplingParams(),
        tokenizer=tokenizer, limits=limits, tenant="acme",
    )  # fmt: skip
    assert list(req.prompt_token_ids) == tokenizer.encode("Grüße aus München")
    assert req.tenant == "acme" and req.skip_special_tokens
    assert len(req.request_id) == 32 and int(req.request_id, 16) >= 0


def test_request_ids_are_unique_unless_given(tokenizer: Tokenizer, limits: ModelLimits) -> None:
    a = prepare_request(
        text="a", token_ids=None, params=SamplingParams(), tokenizer=tokenizer, limits=limits
    )
    b = prepare_request(
        text="a", token_ids=None, params=SamplingParams(), tokenizer=tokenizer, limits=limits
    )
    assert a.request_id != b.request_id
    c = prepare_request(
        text="a", token_ids=None, params=SamplingParams(), tokenizer=tokenizer, limits=limits,
        request_id="req-7",
    )  # fmt: skip
    assert c.request_id == "req-7"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "prompt"),
        ({"text": "a", "token_ids": [1]}, "prompt"),
        ({"text": ""}, "text"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -1]}, "token_ids"),
        ({"token_ids": [1, "vocab"]}, "token_ids"),
        ({"token_ids": "too long"}, "token_ids"),
        ({"token_ids": [1], "params": "too many"}, "sampling.max_tokens"),
        (
            {"token_ids": [1], "params": SamplingParams(stop_token_ids=(10**6,))},
            "sampling.stop_token_ids",
        ),
        ({"text": "a", "request_id": ""}, "request_id"),
        ({"text": "a", "request_id": "a\nb"}, "request_id"),
        ({"text": "a", "tenant": "t" * 300}, "tenant"),
    ],
)
def test_invalid_requests_name_the_field(
    tokenizer: Tokenizer, limits: ModelLimits, kwargs: dict[str, object], field: str
) -> None:
    # Placeholders that depend on the model's limits:
    if kwargs.get("token_ids") == [1, "vocab"]:
        kwargs = {**kwargs, "token_ids": [1, limits.vocab_size]}
    if kwargs.get("token_ids") == "too long":
        kwargs = {**kwargs, "token_ids": [1] * limits.max_model_len}
    if kwargs.get("params") == "too many":
        kwargs = {**kwargs, "params": SamplingParams(max_tokens=limits.max_model_len)}
    with pytest.raises(InvalidArgumentError) as info:
        _prepare(tokenizer, limits, **kwargs)
    assert info.value.field == field


def test_prompt_plus_max_tokens_may_fill_the_model_exactly(
    tokenizer: Tokenizer, limits: ModelLimits
) -> None:
    req = _prepare(
        tokenizer,
        limits,
        token_ids=[1] * 10,
        params=SamplingParams(max_tokens=limits.max_model_len - 10),
    )
    assert len(req.prompt_token_ids) == 10  # type: ignore[attr-defined]


def _stream(text: ResponseText, tokens: list[int]) -> tuple[str, bool]:
    parts = []
    stopped = False
    for t in tokens:
        stopped = text.add(t)
        parts.append(text.take(final=stopped))
        if stopped:
            break
    if not stopped:
        parts.append(text.take(final=True))
    return "".join(parts), stopped


def test_response_text_equals_decode(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode("Zażółć gęślą jaźń, 東京 and 🙂 too", add_bos=False)
    text, stopped = _stream(ResponseText(tokenizer, ()), tokens)
    assert text == tokenizer.decode(tokens) and not stopped


def test_response_text_cuts_stop_strings(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode("one two three four", add_bos=False)
    for skip in (True, False):
        text, stopped = _stream(ResponseText(tokenizer, ("thr",), skip_special_tokens=skip), tokens)
        assert stopped and text == "one two "


def test_special_tokens_are_rendered_only_when_asked(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    tokens = [*tokenizer.encode("hello", add_bos=False), eos]
    skipped, _ = _stream(ResponseText(tokenizer, ()), tokens)
    kept, _ = _stream(ResponseText(tokenizer, (), skip_special_tokens=False), tokens)
    assert skipped == tokenizer.decode(tokens, skip_special_tokens=True)
    assert kept == tokenizer.decode(tokens, skip_special_tokens=False) != skipped


@pytest.mark.parametrize(
    ("min_tokens", "stop", "expected"),
    [
        (0, "two", "one "),
        (2, "two", "one two three "),  # the first "two" is the text of the first 2 tokens
        (4, "two", "one two three two one"),
        (1, "e t", "on"),
        # Begins in the text of the first 3 tokens, ends in the 4th's: it counts (vLLM's rule).
        (3, "e t", "one two thre"),
    ],
)
def test_min_tokens_keeps_stop_strings_out_of_the_first_tokens_text(
    tokenizer: Tokenizer, min_tokens: int, stop: str, expected: str
) -> None:
    tokens = tokenizer.encode("one two three two one", add_bos=False)
    assert len(tokens) == 5
    for skip in (True, False):
        text = ResponseText(tokenizer, (stop,), skip_special_tokens=skip, min_tokens=min_tokens)
        assert _stream(text, tokens) == (expected, expected != "one two three two one")
