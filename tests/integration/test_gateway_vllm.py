"""vLLM's request fields over HTTP on a real cluster, driven by the official ``openai`` client
(``extra_body`` for vLLM's), each answer compared with the same request over gRPC: the
sampling controls (completions and chat, whole and streamed), logprobs with their top
alternatives (also against HF transformers), ``prompt_logprobs``, ``echo``, and the utility
routes (``/v1/models/{id}``, ``/tokenize``, ``/detokenize``, ``/version``, ``/metrics``).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from pdserve import __version__
from pdserve.client import Client, Completion
from pdserve.launcher import Cluster
from pdserve.tokenizer import Tokenizer
from tests.unit.engine.hf_reference import HFReference

pytestmark = pytest.mark.integration

WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "256")
MODEL = "tiny-vllm"
ATOL = 1e-4
MESSAGES = [{"role": "user", "content": "Tell me about the sea and the ships on it."}]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[Cluster]:
    with Cluster(
        tiny_llama_dir, worker_args=WORKER_ARGS, http_port=0,
        gateway_args=["--served-model-name", MODEL],
    ) as c:  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def oai(cluster: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(cluster: Cluster) -> Iterator[Client]:
    with Client(cluster.router_address, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    """A prompt whose tokens the model likes to repeat, so that penalties change the output."""
    rng = random.Random(5)
    return [rng.randrange(4, 2048) for _ in range(60)]


def _ids(choice: Any) -> list[int]:
    ids = choice.model_extra["token_ids"]
    assert isinstance(ids, list)
    return ids


def _controls(plain: list[int], tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """Request fields of each control (OpenAI's as keywords, vLLM's in ``extra_body``)."""
    word = tokenizer.decode(plain[:1]).strip()
    return [
        {"presence_penalty": 1.5, "frequency_penalty": 1.0},
        {"extra_body": {"repetition_penalty": 1.5}},
        {"temperature": 1.0, "seed": 3, "extra_body": {"min_p": 0.3}},
        {"temperature": 1.0, "seed": 4, "extra_body": {"top_k": 2}},
        {"extra_body": {"min_tokens": 6, "stop_token_ids": [plain[0]]}},
        {"logit_bias": {str(plain[3]): 100}},
        {"extra_body": {"allowed_token_ids": [plain[5], plain[6], 9]}},
        {"extra_body": {"bad_words": [word]}} if word else {"logit_bias": {str(plain[0]): -100}},
        {"stop": [tokenizer.decode(plain[2:4])], "extra_body": {"ignore_eos": True}},
    ]


def _grpc(fields: dict[str, Any]) -> dict[str, Any]:
    """The same fields as the SDK's keyword arguments."""
    out = {k: v for k, v in fields.items() if k != "extra_body"}
    out.update(fields.get("extra_body", {}))
    if "logit_bias" in out:
        out["logit_bias"] = {int(k): v for k, v in out["logit_bias"].items()}
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out


def test_sampling_controls_match_grpc(
    oai: openai.OpenAI, grpc_client: Client, prompt_ids: list[int], tokenizer: Tokenizer
) -> None:
    base = {"max_tokens": 8, "temperature": 0}
    plain = grpc_client.generate(prompt_ids, **base).token_ids  # type: ignore[arg-type]
    changed = 0
    for fields in _controls(plain, tokenizer):
        sent = {**base, **fields}
        extra = {**sent.pop("extra_body", {}), "return_token_ids": True}
        expected = grpc_client.generate(prompt_ids, **_grpc({**base, **fields}))
        changed += expected.token_ids != plain
        answer = oai.completions.create(model=MODEL, prompt=prompt_ids, extra_body=extra, **sent)
        assert _ids(answer.choices[0]) == expected.token_ids, fields
        assert answer.choices[0].text == expected.text, fields
        stream = oai.completions.create(
            model=MODEL, prompt=prompt_ids, extra_body=extra, stream=True, **sent
        )
        streamed = [t for chunk in stream for c in chunk.choices for t in _ids(c)]
        assert streamed == expected.token_ids, fields
    assert changed >= 7  # each control but the stop string changes this prompt's tokens


def test_chat_sampling_controls_match_grpc(
    oai: openai.OpenAI, grpc_client: Client, tokenizer: Tokenizer, tiny_llama_dir: Path
) -> None:
    reply = httpx.post(f"{oai.base_url}".replace("/v1/", "/tokenize"),
                       json={"model": MODEL, "messages": MESSAGES})  # fmt: skip
    chat_ids = reply.json()["tokens"]
    base = {"max_tokens": 8, "temperature": 0}
    plain = grpc_client.generate(chat_ids, **base).token_ids  # type: ignore[arg-type]
    for fields in _controls(plain, tokenizer):
        sent = {**base, **fields}
        extra = {**sent.pop("extra_body", {}), "return_token_ids": True}
        expected = grpc_client.generate(chat_ids, **_grpc({**base, **fields}))
        answer = oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            extra_body=extra,
            **sent,  # type: ignore[arg-type]
        )
        assert _ids(answer.choices[0]) == expected.token_ids, fields


def _top_dict(tokenizer: Tokenizer, done: Completion, i: int) -> dict[str, float]:
    top = done.top_logprobs[i]
    out = {
        tokenizer.decode([t], False): lp for t, lp in zip(top.token_ids, top.logprobs, strict=True)
    }
    out.setdefault(tokenizer.decode([done.token_ids[i]], False), done.logprobs[i])
    return out


def test_completion_logprobs_and_echo_match_grpc_and_hf(
    oai: openai.OpenAI, grpc_client: Client, tokenizer: Tokenizer, tiny_llama_dir: Path
) -> None:
    prompt = "The sea was calm and the ships"
    expected = grpc_client.generate(
        prompt, max_tokens=5, temperature=0, logprobs=5, prompt_logprobs=5
    )
    answer = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=5, echo=True
    )
    (choice,) = answer.choices
    pl = expected.prompt_logprobs
    assert pl is not None and choice.text == prompt + expected.text
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    n = len(pl.token_ids)
    assert logprobs.tokens == [tokenizer.decode([t], False) for t in pl.token_ids] + [
        tokenizer.decode([t], False) for t in expected.token_ids
    ]
    assert logprobs.token_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(
        [*pl.logprobs, *expected.logprobs], abs=1e-5
    )
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None
    for i in range(len(expected.token_ids)):
        assert logprobs.top_logprobs[n + i] == pytest.approx(_top_dict(tokenizer, expected, i))
        assert len(logprobs.top_logprobs[n + i]) in (5, 6)  # the top 5 and the sampled token
    # Against HF: the echoed prompt's logprobs and the alternatives of each generated token.
    hf = HFReference(tiny_llama_dir)
    reference = torch.log_softmax(hf.logits(pl.token_ids + expected.token_ids), dim=-1)
    ids = pl.token_ids + expected.token_ids
    for i in range(1, len(ids)):
        assert logprobs.token_logprobs[i] == pytest.approx(float(reference[i - 1, ids[i]]),
                                                           abs=ATOL)  # fmt: skip
    values, tokens = torch.topk(reference[n - 1], 5)
    first = logprobs.top_logprobs[n]
    assert first is not None
    assert [first[tokenizer.decode([t], False)] for t in tokens.tolist()] == pytest.approx(
        values.tolist(), abs=ATOL
    )
    # Streamed: the echoed prompt comes with the first chunk, the logprobs the same.
    chunks = list(oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=5, echo=True,
        stream=True,
    ))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[0].choices[0].text.startswith(prompt)
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.token_logprobs or [])]  # type: ignore[union-attr]
    assert streamed == logprobs.token_logprobs


def test_prompt_logprobs_in_vllm_s_shape(
    oai: openai.OpenAI, grpc_client: Client, tokenizer: Tokenizer
) -> None:
    prompt = [1, 523, 97, 1203, 44, 9]
    expected = grpc_client.generate(prompt, max_tokens=2, temperature=0, prompt_logprobs=2)
    pl = expected.prompt_logprobs
    assert pl is not None
    for answer in (
        oai.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                               extra_body={"prompt_logprobs": 2}).choices[0],
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,  # type: ignore[arg-type]
                                    extra_body={"prompt_logprobs": 2}),
    ):  # fmt: skip
        assert answer.model_extra is not None
        got = answer.model_extra["prompt_logprobs"]
        assert got[0] is None
        if isinstance(answer, openai.types.CompletionChoice):
            for i, entries in enumerate(got[1:]):
                token, top = pl.token_ids[i + 1], pl.top[i]
                assert entries[str(token)]["logprob"] == pytest.approx(pl.logprobs[i], abs=1e-5)
                assert entries[str(token)]["rank"] == pl.ranks[i]
                assert entries[str(token)]["decoded_token"] == tokenizer.decode([token], False)
                for j, t in enumerate(top.token_ids):
                    assert entries[str(t)]["rank"] == (pl.ranks[i] if t == token else j + 1)
        else:
            assert all(len(entries) in (2, 3) for entries in got[1:])


def test_chat_top_logprobs_match_grpc(
    oai: openai.OpenAI, grpc_client: Client, tokenizer: Tokenizer
) -> None:
    reply = httpx.post(f"{oai.base_url}".replace("/v1/", "/tokenize"),
                       json={"model": MODEL, "messages": MESSAGES})  # fmt: skip
    expected = grpc_client.generate(reply.json()["tokens"], max_tokens=4, temperature=0,
                                    logprobs=3)  # fmt: skip
    for stream in (False, True):
        created = oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,  # type: ignore[arg-type]
            logprobs=True, top_logprobs=3, stream=stream,
        )  # fmt: skip
        if stream:
            content = [t for c in created for ch in c.choices if ch.logprobs  # type: ignore[union-attr]
                       for t in ch.logprobs.content or []]  # fmt: skip
        else:
            content = created.choices[0].logprobs.content  # type: ignore[union-attr]
        assert [t.logprob for t in content] == pytest.approx(expected.logprobs, abs=1e-5)
        for item, top in zip(content, expected.top_logprobs, strict=True):
            assert [t.token for t in item.top_logprobs] == [
                tokenizer.decode([i], False) for i in top.token_ids
            ]
            assert [t.logprob for t in item.top_logprobs] == pytest.approx(top.logprobs, abs=1e-5)
            assert item.bytes == list(item.token.encode())


def test_utility_routes(cluster: Cluster, oai: openai.OpenAI, grpc_client: Client) -> None:
    card = oai.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra is not None
    assert card.model_extra["max_model_len"] == grpc_client.model_info().max_model_len
    with pytest.raises(openai.NotFoundError) as err:
        oai.models.retrieve("no-such-model")
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "model_not_found"
    url = cluster.http_url
    text = "The sea was calm"
    tokens = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}).json()
    done = grpc_client.generate(text, max_tokens=1)
    assert done.usage is not None and tokens["count"] == done.usage.prompt_tokens
    reply = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})
    assert reply.json()["prompt"].endswith(text)
    assert httpx.get(f"{url}/version").json() == {"version": __version__}
    metrics = httpx.get(f"{url}/metrics").text
    assert 'pdserve_http_requests_total{route="/tokenize",status="200"}' in metrics


def test_a_request_id_in_use_is_a_409(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": "The sea", "max_tokens": 2000, "ignore_eos": True,
            "request_id": "mine", "stream": True}  # fmt: skip
    url = f"{cluster.http_url}/v1/completions"
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # held: a dropped iterator closes the stream
        first = next(line for line in lines if line)
        assert '"id":"cmpl-mine"' in first
        again = http.post(url, json={**body, "stream": False, "max_tokens": 2})
        assert again.status_code == 409, again.text
        error = again.json()["error"]
        assert (error["param"], error["code"]) == ("request_id", "already_exists")
        assert error["message"] == "request_id: 'cmpl-mine-0' is already in flight for this tenant"
        assert [line for line in lines if line][-1] == "data: [DONE]"  # the first one went on


def test_continuous_usage_stats(cluster: Cluster, grpc_client: Client) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (``pdserve bench serve``'s OpenAI
    target asks for it): every chunk carries its choice's usage so far."""
    prompt = "The sea was calm"
    done = grpc_client.generate(prompt, max_tokens=6, temperature=0)
    assert done.usage is not None
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in [
        ("completions", {"prompt": prompt}),
        ("chat/completions", {"messages": MESSAGES}),
    ]:
        body = {**body, "model": MODEL, "max_tokens": 6, "temperature": 0, "stream": True,
                "stream_options": options, "return_token_ids": True}  # fmt: skip
        with httpx.stream("POST", f"{cluster.http_url}/v1/{path}", json=body) as reply:
            events = [line.removeprefix("data: ") for line in reply.iter_lines() if line]
        chunks = [json.loads(e) for e in events[:-1]]
        counted = 0
        for chunk in chunks[:-1]:  # the last: include_usage's, with no choices
            for choice in chunk["choices"]:
                counted += len(choice.get("token_ids") or [])
            assert chunk["usage"]["completion_tokens"] == counted, chunk
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
        if path == "completions":
            assert {c["usage"]["prompt_tokens"] for c in chunks} == {done.usage.prompt_tokens}


def test_structured_output_through_the_openai_client(oai: openai.OpenAI) -> None:
    """OpenAI's response_format json_schema (chat) and vLLM's guided_* (completions) reach
    the engine's grammar: every sampled answer is valid, and ends because it is complete."""
    import jsonschema

    from tests.unit.engine.test_guided import CHOICES, REGEX, SCHEMA

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for seed in range(4):
        chat = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format=fmt, max_tokens=400, temperature=1.0, seed=seed,  # type: ignore[arg-type]
        )  # fmt: skip
        choice = chat.choices[0]
        assert choice.finish_reason == "stop", choice
        # strict=False: xgrammar 0.2.8's JSON strings admit raw control characters other
        # than CR and LF (JSON escapes them); docs/sampling.md says so.
        jsonschema.validate(json.loads(choice.message.content or "", strict=False), SCHEMA)
        for extra, ok in (({"guided_choice": list(CHOICES)}, lambda t: t in CHOICES),
                          ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t))):  # fmt: skip
            done = oai.completions.create(model=MODEL, prompt="Pick:", max_tokens=200,
                                          temperature=1.0, seed=seed, extra_body=extra)  # fmt: skip
            assert done.choices[0].finish_reason == "stop" and ok(done.choices[0].text), extra
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=4,
                               extra_body={"guided_regex": "(["})  # fmt: skip
    assert "guided_regex" in str(err.value)


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
FLAG_PARAMETERS = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "set_flag", "parameters": FLAG_PARAMETERS}},
]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "set_flag": FLAG_PARAMETERS}


def _streamed_calls(chunks: list[Any]) -> tuple[list[tuple[str, str]], str | None]:
    """The calls of a stream, accumulated as OpenAI's clients do, and its finish reason."""
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for piece in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if piece.id is not None:
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
    return [(n, a) for _, (n, a) in sorted(calls.items())], chunks[-1].choices[0].finish_reason


def test_tool_choice_required_and_named_through_the_openai_client(oai: openai.OpenAI) -> None:
    """``tool_choice`` a named function or ``required`` guides the random model's answer: it
    is always calls of the right functions whose arguments a strict JSON parser reads and the
    function's schema takes (``jsonschema``), and the stream of the same seeded request gives
    the same calls, piece by piece."""
    import jsonschema

    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(2):
        for choice, parallel in ((named, None), ("required", False), ("required", None)):
            ask: dict[str, Any] = {
                "model": MODEL, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": TOOLS, "tool_choice": choice, "max_tokens": 300, "temperature": 1.0,
                "seed": seed,
            }  # fmt: skip
            if parallel is not None:
                ask["parallel_tool_calls"] = parallel
            done = oai.chat.completions.create(**ask).choices[0]
            assert done.finish_reason == "tool_calls", done
            assert done.message.content is None and done.message.tool_calls
            calls = [(c.function.name, c.function.arguments) for c in done.message.tool_calls]  # type: ignore[union-attr]
            if choice is named:
                assert [name for name, _ in calls] == ["get_weather"]
            if parallel is False:
                assert len(calls) == 1
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), PARAMETERS[name])
            chunks = list(oai.chat.completions.create(**ask, stream=True))
            assert _streamed_calls(chunks) == (calls, "tool_calls"), (choice, seed)
