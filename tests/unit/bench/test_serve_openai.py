"""The OpenAI-compatible target of `bench serve` against a real local HTTP server (stdlib)
that streams completions as server-sent events, as vLLM and SGLang do."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pdserve_bench.serve.mixes import SHORT_ONLY
from pdserve_bench.serve.openai import OpenAITarget, sse_data, sse_lines
from pdserve_bench.serve.records import Status
from pdserve_bench.serve.runner import run_point
from pdserve_bench.serve.targets import RejectedError, TargetDownError, TargetError
from pdserve_bench.serve.workload import Load

from .fakes import FakeOpenAI, url_of


async def _collect(target: OpenAITarget, prompt: list[int], max_tokens: int) -> list[Any]:
    await target.open()
    try:
        return [c async for c in target.stream(prompt, max_tokens)]
    finally:
        await target.close()


@pytest.mark.parametrize("mode", ["token_ids", "usage"])
def test_point_against_the_sse_server(openai_server: FakeOpenAI, mode: str) -> None:
    openai_server.mode = mode
    load = Load(1000, mix=SHORT_ONLY, num_requests=4, burst=0, seed=2)
    plan = load.plan(None)
    target = OpenAITarget(url_of(openai_server) + "/v1/", "fake")

    async def go() -> Any:
        await target.open()
        try:
            return await run_point(target, plan, request_timeout_s=30.0)
        finally:
            await target.close()

    records = asyncio.run(go())
    assert target.model == "fake-model"  # asked GET /v1/models
    for rec, req in zip(records, plan.requests, strict=True):
        assert rec.status is Status.OK, rec.error
        assert rec.output_tokens == req.output_tokens == sum(rec.chunk_tokens)
        assert rec.reported_tokens == req.output_tokens
        assert len(rec.chunk_s) == req.output_tokens - 1  # one event carried two tokens
    bodies = sorted(openai_server.bodies, key=lambda b: b["prompt"])
    wanted = sorted(plan.requests, key=lambda r: list(r.prompt))
    for body, req in zip(bodies, wanted, strict=True):
        assert body["prompt"] == list(req.prompt) and body["max_tokens"] == req.output_tokens
        assert body["model"] == "fake-model" and body["temperature"] == 0
        assert body["stream"] is True and body["ignore_eos"] is True


def test_plain_servers_undercount_merged_tokens_and_that_shows(openai_server: FakeOpenAI) -> None:
    """Without token ids or usage, an event is one token: a merged event leaves the stream a
    token short, which the runner reports as an error rather than passing it off."""
    openai_server.mode = "plain"
    chunks = asyncio.run(_collect(OpenAITarget(url_of(openai_server), "f", model="m"), [20, 21], 5))
    assert sum(c.tokens for c in chunks) == 4 and chunks[-1].usage_tokens == 5


@pytest.mark.parametrize(
    ("mode", "error", "admitted", "message"),
    [
        ("429", RejectedError, False, "HTTP 429"),
        ("500", TargetError, False, "HTTP 500"),
        ("no-done", TargetError, True, r"without \[DONE\]"),
        ("error-event", TargetError, True, "engine died"),
    ],
)
def test_failures(
    openai_server: FakeOpenAI, mode: str, error: type[TargetError], admitted: bool, message: str
) -> None:
    openai_server.mode = mode
    target = OpenAITarget(url_of(openai_server), "f", model="m")
    with pytest.raises(error, match=message) as info:
        asyncio.run(_collect(target, [20, 21, 22], 4))
    assert info.value.admitted is admitted


def test_unreachable_server() -> None:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = OpenAITarget(f"http://127.0.0.1:{port}", "f", model="m")
    with pytest.raises(TargetError, match="ConnectError") as info:
        asyncio.run(_collect(target, [20], 2))
    assert info.value.admitted is False
    with pytest.raises(TargetDownError, match="--openai-model"):
        asyncio.run(OpenAITarget(f"http://127.0.0.1:{port}", "f").open())


def test_sse_data_joins_lines_and_skips_comments() -> None:
    async def lines() -> AsyncIterator[str]:
        for line in [": hi", "event: x", 'data: {"a":', "data:1}", "", "", "data: [DONE]"]:
            yield line

    async def run() -> list[str]:
        return [d async for d in sse_data(lines())]

    assert asyncio.run(run()) == ['{"a":\n1}', "[DONE]"]


def test_sse_lines_end_only_at_cr_lf_and_keep_unicode_separators() -> None:
    # A token's text can hold U+2028, U+0085 or U+001C unescaped inside a JSON string: a
    # generic line splitter cut such an event in two, and the client read it as corrupt.
    chunks = ['data: {"t": "a\u2028b\x85c\x1cd"}\r', "\n\r\ndata: [DO", "NE]\r\n", "\n"]

    async def feed() -> AsyncIterator[str]:
        for c in chunks:
            yield c

    async def run() -> list[str]:
        return [line async for line in sse_lines(feed())]

    assert asyncio.run(run()) == ['data: {"t": "a\u2028b\x85c\x1cd"}', "", "data: [DONE]", ""]
