"""The OpenAI-compatible gateway on a real cluster, driven by the official ``openai`` client.

Every answer is checked token for token against the same request sent over gRPC with the SDK
(``return_token_ids`` gives the ids over HTTP), chat prompts against ``transformers``'
``apply_chat_template`` of the checkpoint, and errors for their HTTP status and the parameter
they name. 429 comes from a request no worker's KV pool can ever hold, 503 from a gateway whose
router is gone, 504 from a gateway with a deadline too short for any request; a client that
disconnects shows up as a cancelled request in the router's metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import Client, Completion
from pdserve.launcher import Cluster
from pdserve.service_process import ServiceProcess, http_healthy

pytestmark = pytest.mark.integration

WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
               "--heartbeat-interval-s", "0.2")  # fmt: skip
MODEL = "tiny-chat"
PROMPT = "Once upon a time"
WAIT_S = 60.0


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """Poll ``check`` until it holds; the services offer nothing to block on."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, redis_url: str) -> Iterator[Cluster]:
    with Cluster(
        tiny_llama_dir,
        redis_url=redis_url,
        namespace="gateway-test",
        worker_args=WORKER_ARGS,
        http_port=0,
        gateway_args=["--served-model-name", MODEL],
    ) as c:
        yield c


@pytest.fixture(scope="module")
def oai(cluster: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(cluster: Cluster) -> Iterator[Client]:
    with Client(cluster.router_address, timeout=60) as c:
        yield c


def ids_of(choice: Any) -> list[int]:
    ids = choice.model_extra["token_ids"]
    assert isinstance(ids, list)
    return ids


def same(http_ids: list[int], text: str, finish: str | None, expected: Completion) -> None:
    assert http_ids == expected.token_ids
    assert text == expected.text
    assert finish == expected.finish_reason


# -- models, health ------------------------------------------------------------------------------


def test_models_and_health(cluster: Cluster, oai: openai.OpenAI, tiny_llama_dir: Path) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra is not None
    assert models[0].model_extra["root"] == str(tiny_llama_dir)
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert models[0].model_extra["max_model_len"] == config["max_position_embeddings"]
    health = httpx.get(f"{cluster.http_url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


# -- /v1/completions -----------------------------------------------------------------------------

CASES = [
    pytest.param(PROMPT, {"temperature": 0}, id="text-greedy"),
    pytest.param([1, 523, 97, 1203, 44], {"temperature": 0}, id="ids-greedy"),
    pytest.param(PROMPT, {"temperature": 0.9, "top_p": 0.8, "seed": 1234}, id="seeded"),
    pytest.param(PROMPT, {"temperature": 0, "ignore_eos": True, "top_k": 5}, id="extensions"),
]


def _extra(sampling: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(openai keyword arguments, extra_body) of a case's sampling parameters."""
    extensions = {k: v for k, v in sampling.items() if k in ("ignore_eos", "top_k")}
    plain = {k: v for k, v in sampling.items() if k not in extensions}
    return plain, {"return_token_ids": True, **extensions}


@pytest.mark.parametrize(("prompt", "sampling"), CASES)
def test_completion_matches_grpc(
    oai: openai.OpenAI,
    grpc_client: Client,
    prompt: str | list[int],
    sampling: dict[str, Any],
) -> None:
    plain, extra = _extra(sampling)
    answer = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, extra_body=extra, **plain
    )
    expected = grpc_client.generate(prompt, max_tokens=12, **sampling)
    (choice,) = answer.choices
    same(ids_of(choice), choice.text, choice.finish_reason, expected)
    assert answer.object == "text_completion" and answer.model == MODEL
    assert expected.usage is not None and answer.usage is not None
    assert answer.usage.prompt_tokens == expected.usage.prompt_tokens
    assert answer.usage.completion_tokens == expected.usage.completion_tokens == 12
    assert answer.usage.total_tokens == expected.usage.prompt_tokens + 12
    details = answer.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == expected.usage.cached_tokens


def test_stream_matches_grpc(oai: openai.OpenAI, grpc_client: Client) -> None:
    expected = grpc_client.generate(PROMPT, max_tokens=20, temperature=0)
    chunks = list(
        oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
        )
    )  # fmt: skip
    *deltas, usage_chunk = chunks
    assert len(deltas) > 1  # streamed, not one piece
    assert all(c.choices[0].index == 0 for c in deltas)
    ids = [t for c in deltas for t in ids_of(c.choices[0])]
    text = "".join(c.choices[0].text for c in deltas)
    assert [c.choices[0].finish_reason for c in deltas[:-1]] == [None] * (len(deltas) - 1)
    same(ids, text, deltas[-1].choices[0].finish_reason, expected)
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert expected.usage is not None
    assert usage_chunk.usage.prompt_tokens == expected.usage.prompt_tokens
    assert usage_chunk.usage.completion_tokens == 20


def test_sse_wire_format(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    parsed = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {p["id"] for p in parsed} == {parsed[0]["id"]}
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"


def test_batch_and_n(oai: openai.OpenAI, grpc_client: Client) -> None:
    prompts = [PROMPT, "The capital of France"]
    answer = oai.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=7,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    for choice in answer.choices:
        prompt, j = prompts[choice.index // 2], choice.index % 2
        expected = grpc_client.generate(prompt, max_tokens=6, temperature=1.0, seed=7 + j)
        same(ids_of(choice), choice.text, choice.finish_reason, expected)
    assert answer.usage is not None
    single = [grpc_client.generate(p, max_tokens=1).usage for p in prompts]
    assert answer.usage.prompt_tokens == sum(u.prompt_tokens for u in single if u is not None)
    assert answer.usage.completion_tokens == 4 * 6


def test_streamed_n_merges_choices(oai: openai.OpenAI, grpc_client: Client) -> None:
    stream = oai.completions.create(
        model=MODEL, prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=11, stream=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished: dict[int, str | None] = {}
    for chunk in stream:
        (choice,) = chunk.choices
        ids[choice.index] += ids_of(choice)
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    for j in range(3):
        expected = grpc_client.generate(PROMPT, max_tokens=8, temperature=1.0, seed=11 + j)
        assert ids[j] == expected.token_ids
        assert finished[j] == expected.finish_reason


def test_stop_string(oai: openai.OpenAI, grpc_client: Client) -> None:
    full = grpc_client.generate(PROMPT, max_tokens=16, temperature=0)
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), full.text  # the cut falls inside the text
    answer = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    expected = grpc_client.generate(PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert answer.choices[0].text == expected.text == full.text[: full.text.index(stop)]
    assert answer.choices[0].finish_reason == "stop"


def test_logprobs(oai: openai.OpenAI, grpc_client: Client) -> None:
    answer = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1
    )
    expected = grpc_client.generate(PROMPT, max_tokens=6, temperature=0)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.token_logprobs == pytest.approx(expected.logprobs)
    assert logprobs.tokens is not None and len(logprobs.tokens) == 6
    assert logprobs.top_logprobs is not None
    assert [list(t) for t in logprobs.top_logprobs] == [[t] for t in logprobs.tokens]


# -- /v1/chat/completions ------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Tell me about the sea."},
]


def hf_chat_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def test_chat_matches_template_and_grpc(
    oai: openai.OpenAI, grpc_client: Client, tiny_llama_dir: Path
) -> None:
    prompt_ids = hf_chat_ids(tiny_llama_dir)
    expected = grpc_client.generate(prompt_ids, max_tokens=10, temperature=0)
    answer = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    (choice,) = answer.choices
    assert choice.message.role == "assistant"
    same(ids_of(choice), choice.message.content or "", choice.finish_reason, expected)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt_ids)

    chunks = list(
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c for c in chunks[1:] if c.choices]
    ids = [t for c in deltas for t in ids_of(c.choices[0])]
    text = "".join(c.choices[0].delta.content or "" for c in deltas)
    same(ids, text, deltas[-1].choices[0].finish_reason, expected)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_chat_logprobs(oai: openai.OpenAI, grpc_client: Client, tiny_llama_dir: Path) -> None:
    expected = grpc_client.generate(hf_chat_ids(tiny_llama_dir), max_tokens=4, temperature=0)
    answer = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=1,
    )  # fmt: skip
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [t.logprob for t in logprobs.content] == pytest.approx(expected.logprobs)
    assert all(t.top_logprobs[0].token == t.token for t in logprobs.content)


# -- errors --------------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    pytest.param({"max_tokens": 100_000}, "max_tokens", id="max_tokens-past-context"),
    pytest.param({"temperature": -1}, "temperature", id="temperature"),
    pytest.param({"top_p": 0}, "top_p", id="top_p"),
    pytest.param({"prompt": [1, 2, 999_999]}, "prompt", id="token-out-of-vocab"),
    pytest.param({"prompt": ""}, "prompt", id="empty-prompt"),
    pytest.param({"max_tokens": "many"}, "max_tokens", id="not-an-int"),
    pytest.param({"n": 0}, "n", id="n"),
    pytest.param({"logprobs": 21}, "logprobs", id="top-21-logprobs"),
    pytest.param({"frequency_penalty": 2.5}, "frequency_penalty", id="penalty"),
    pytest.param({"logit_bias": {"3": 101}}, "logit_bias", id="bias-range"),
    pytest.param({"logit_bias": {"x": 1}}, "logit_bias", id="bias-key"),
    pytest.param({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids", id="allowed"),
    pytest.param({"extra_body": {"min_tokens": 5}}, "min_tokens", id="min-tokens"),
    pytest.param({"extra_body": {"use_beam_search": True}}, "use_beam_search", id="beams"),
    pytest.param(
        {"extra_body": {"guided_whitespace_pattern": " "}},
        "guided_whitespace_pattern",
        id="guided-whitespace",
    ),
    pytest.param({"extra_body": {"guided_regex": "(["}}, "guided_regex", id="guided-regex"),
    pytest.param({"extra_body": {"frobnicate": 1}}, "frobnicate", id="unknown-field"),
]


@pytest.mark.parametrize(("change", "param"), BAD_COMPLETIONS)
def test_completion_400_names_the_param(
    oai: openai.OpenAI, change: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(**body)
    error = err.value.body
    assert isinstance(error, dict)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ")


BAD_CHATS = [
    pytest.param({"messages": []}, "messages", id="no-messages"),
    pytest.param({"messages": [{"content": "hi"}]}, "messages[0].role", id="no-role"),
    pytest.param({"max_completion_tokens": 100_000}, "max_completion_tokens", id="max-tokens"),
    pytest.param({"tools": [{"type": "function"}]}, "tools[0].function", id="tools"),
]


@pytest.mark.parametrize(("change", "param"), BAD_CHATS)
def test_chat_400_names_the_param(cluster: Cluster, change: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **change}
    reply = httpx.post(f"{cluster.http_url}/v1/chat/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param


def test_unknown_model_is_404(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        oai.completions.create(model="gpt-unknown", prompt=PROMPT, max_tokens=2)
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "model_not_found"


def test_request_no_worker_can_hold_is_429(oai: openai.OpenAI) -> None:
    # 256 KV blocks of 16 tokens per worker hold far fewer than 8000 tokens: every worker refuses.
    with pytest.raises(openai.RateLimitError) as err:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8000)
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "resource_exhausted"
    for stream in (True, False):  # a refused stream gets the status too, not a 200
        reply = httpx.post(
            f"{oai.base_url}completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8000, "stream": stream},
        )
        assert reply.status_code == 429, reply.text


@contextlib.contextmanager
def _gateway(tmp_path: Path, model_dir: Path, router: str, *extra: str) -> Iterator[ServiceProcess]:
    name = f"gateway-{len(list(tmp_path.iterdir()))}"
    gateway = ServiceProcess(
        name, "services.gateway",
        ["--router", router, "--model", str(model_dir), "--metrics-port", "-1", *extra],
        port_file=tmp_path / f"{name}.port", log_file=tmp_path / f"{name}.log", http=True,
    )  # fmt: skip
    gateway.spawn({**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for("the gateway's port", lambda: (gateway.check_alive(), gateway.read_port())[1])
        yield gateway
    finally:
        assert gateway.proc is not None
        gateway.proc.terminate()
        gateway.proc.wait(timeout=30)


def test_router_gone_is_503(tmp_path: Path, tiny_llama_dir: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with _gateway(tmp_path, tiny_llama_dir, dead) as gateway:
        url = f"http://{gateway.address}"
        assert not http_healthy(gateway.address)
        assert httpx.get(f"{url}/health").status_code == 503
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT}, timeout=60)
        assert reply.status_code == 503
        assert reply.json()["error"]["type"] == "service_unavailable_error"


def test_deadline_is_504(tmp_path: Path, tiny_llama_dir: Path, cluster: Cluster) -> None:
    with _gateway(
        tmp_path, tiny_llama_dir, cluster.router_address, "--timeout-s", "0.001"
    ) as gateway:
        reply = httpx.post(
            f"http://{gateway.address}/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True},
            timeout=60,
        )
        assert reply.status_code == 504
        assert reply.json()["error"]["code"] == "deadline_exceeded"


# -- client disconnect ---------------------------------------------------------------------------


def cancelled_count(cluster: Cluster) -> float:
    text = httpx.get(cluster.metrics_urls()["router"]).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdserve_requests_total" and sample.labels == {
                "outcome": "cancelled"
            }:
                return float(sample.value)
    return 0.0


def test_stream_disconnect_cancels(cluster: Cluster) -> None:
    before = cancelled_count(cluster)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3500, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{cluster.http_url}/v1/completions", json=body) as reply,
    ):
        assert reply.status_code == 200
        first = next(line for line in reply.iter_lines() if line)
        assert first.startswith("data: {")
    wait_for("the cancelled request", lambda: cancelled_count(cluster) > before)
    wait_for("the KV blocks to be freed", lambda: decode_blocks_in_use(cluster) == 0)


def test_unary_disconnect_cancels(cluster: Cluster) -> None:
    before = cancelled_count(cluster)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 3500,
                       "ignore_eos": True}).encode()  # fmt: skip
    host, port = cluster.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # Hang up once the decode worker holds the request's KV blocks.
        wait_for("the request to decode", lambda: decode_blocks_in_use(cluster) > 0)
    wait_for("the cancelled request", lambda: cancelled_count(cluster) > before)
    wait_for("the KV blocks to be freed", lambda: decode_blocks_in_use(cluster) == 0)


def decode_blocks_in_use(cluster: Cluster) -> float:
    """KV blocks the decode worker holds now (total minus free)."""
    text = httpx.get(cluster.metrics_urls()["decode-0"]).text
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in ("pdserve_kv_blocks_free", "pdserve_kv_blocks_total")
    }
    return values["pdserve_kv_blocks_total"] - values["pdserve_kv_blocks_free"]
