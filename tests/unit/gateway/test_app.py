"""The gateway's HTTP app in process, in front of a router stand-in on a real gRPC socket with
the router's own key check (``stub_router``): the order of the checks (the key from the headers
before any byte of the body, then the size limit while reading), what a refusal leaves unread,
the key verdicts remembered, oversize prompts as 400s (gRPC's own "larger than max" included),
large bodies prepared on the worker threads, and a failure of the gateway answered in OpenAI's
shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.gateway import Gateway, GatewayConfig, create_app
from pdserve.gateway.protocol import ChatMessage
from pdserve.gateway.toolparse import CallSyntax
from pdserve.telemetry.metrics import GatewayMetrics
from pdserve.tokenizer import Tokenizer
from tests.unit.gateway.stub_router import KEY, StubRouter, start_stub

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_BODY = 64 * 1024
AUTH = (b"authorization", f"Bearer {KEY}".encode())


@dataclass
class Harness:
    stub: StubRouter
    gateway: Gateway
    http: httpx.AsyncClient
    encoded: list[int] = field(default_factory=list)
    """Length of each text the gateway's tokenizer encoded."""

    @property
    def app(self) -> Callable[..., Awaitable[None]]:
        transport = self.http._transport
        assert isinstance(transport, httpx.ASGITransport)
        return transport.app  # type: ignore[no-any-return]


@asynccontextmanager
async def harness(
    model_dir: Path, *, keys: bool = True, max_receive_bytes: int = 4 << 20,
    max_prompt_tokens: int = 8192, max_body: int = MAX_BODY, allow_unknown_fields: bool = False,
    chat_template: Path | None = None, metrics: GatewayMetrics | None = None,
    tool_call_parser: CallSyntax = CallSyntax.HERMES,
) -> AsyncIterator[Harness]:  # fmt: skip
    stub = StubRouter(max_model_len=8192, max_prompt_tokens=max_prompt_tokens)
    server, address = await start_stub(stub, keys=keys, max_receive_bytes=max_receive_bytes)
    gateway = Gateway.load(GatewayConfig(router=address, model_dir=model_dir,
                                         max_body_bytes=max_body, timeout_s=30,
                                         allow_unknown_fields=allow_unknown_fields,
                                         chat_template=chat_template,
                                         tool_call_parser=tool_call_parser))  # fmt: skip
    app = create_app(gateway, metrics)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    http = httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30)
    h = Harness(stub, gateway, http)
    tokenizer: Tokenizer = gateway.preparer.tokenizer
    encode = tokenizer.encode

    def counted(text: str, add_bos: bool = True, *, release_gil: bool = False) -> list[int]:
        h.encoded.append(len(text))
        return encode(text, add_bos, release_gil=release_gil)

    tokenizer.encode = counted  # type: ignore[method-assign]
    try:
        yield h
    finally:
        await http.aclose()
        await gateway.close()
        await server.stop(None)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 60))


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    pulled: int
    """Body chunks the app asked for."""

    def error(self) -> dict[str, Any]:
        error = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error, dict)
        return error


async def asgi_post(
    app: Callable[..., Awaitable[None]], path: str, headers: Iterable[tuple[bytes, bytes]],
    chunks: Iterable[bytes],
) -> Answer:  # fmt: skip
    """One POST straight to the ASGI app; ``chunks`` are handed over only as the app asks
    (then the connection stays open: the app must not need more)."""
    source = iter(chunks)
    pulled = 0
    started: dict[str, Any] = {}
    body = bytearray()
    hold = asyncio.Event()  # never set: a client that sends nothing more

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        chunk = next(source, None)
        if chunk is None:
            await hold.wait()
        pulled += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            started.update(message)
        else:
            body.extend(message.get("body", b""))

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("gateway", 80), "headers": [(b"host", b"gateway"), *headers]}  # fmt: skip
    await app(scope, receive, send)
    heads = {k.decode(): v.decode() for k, v in started.get("headers", [])}
    return Answer(int(started["status"]), heads, bytes(body), pulled)


def test_no_key_is_401_before_any_byte_of_the_body(tiny_llama_dir: Path) -> None:
    async def test() -> None:
        async with harness(tiny_llama_dir) as h:
            for path in (CHAT, COMPLETIONS):
                for length, close in ((str(MAX_BODY).encode(), False), (b"999999999", True)):
                    answer = await asgi_post(
                        h.app, path, [(b"content-length", length)], [b"{" * 1024] * 10_000
                    )
                    assert (answer.status, answer.pulled) == (401, 0)
                    assert answer.error()["code"] == "invalid_api_key"
                    # Drained (the client then reads the 401) unless the rest may be large.
                    assert (answer.headers.get("connection") == "close") is close
                wrong = (b"authorization", b"Bearer k-not-a-key-at-all-000")
                answer = await asgi_post(h.app, path, [wrong], [b"x"] * 10)  # chunked
                assert (answer.status, answer.pulled) == (401, 0)
                assert answer.headers.get("connection") == "close"
            assert h.encoded == [] and h.gateway.pool.counts.pooled == 0
            assert h.stub.calls["Generate"] == h.stub.calls["GenerateUnary"] == 0

    run(test)


def test_a_body_over_the_limit_is_413_unread(tiny_llama_dir: Path) -> None:
    async def test() -> None:
        async with harness(tiny_llama_dir) as h:
            declared = [AUTH, (b"content-length", str(MAX_BODY + 1).encode())]
            answer = await asgi_post(h.app, CHAT, declared, [b"x"] * 100)
            assert (answer.status, answer.pulled) == (413, 0)
            assert answer.headers["connection"] == "close"
            error = answer.error()
            assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
            assert str(MAX_BODY) in error["message"]
            # Chunked, no length: refused once past the limit, the rest never asked for.
            chunk = b" " * 4096
            answer = await asgi_post(h.app, COMPLETIONS, [AUTH], [chunk] * 1000)
            assert answer.status == 413 and answer.headers["connection"] == "close"
            assert answer.pulled == MAX_BODY // len(chunk) + 1
            assert h.encoded == [] and h.gateway.pool.counts.pooled == 0

    run(test)


def test_the_router_verdicts_are_remembered(tiny_llama_dir: Path) -> None:
    body = {"prompt": "hello", "max_tokens": 1}

    async def test() -> None:
        async with harness(tiny_llama_dir) as h:
            auth = {"Authorization": f"Bearer {KEY}"}
            for _ in range(3):
                reply = await h.http.post(COMPLETIONS, json=body, headers=auth)
                assert reply.status_code == 200, reply.text
            assert h.gateway.callers.asked == 1
            for _ in range(2):  # a refused key is asked again: it may have been added since
                wrong = {"Authorization": "Bearer k-wrong-key-000000"}
                reply = await h.http.post(COMPLETIONS, json=body, headers=wrong)
                assert reply.status_code == 401
            assert h.gateway.callers.asked == 3
            for _ in range(2):  # no key: the router's refusal is remembered
                reply = await h.http.post(COMPLETIONS, json=body)
                assert reply.status_code == 401
                assert "didn't provide an API key" in reply.json()["error"]["message"]
            assert h.gateway.callers.asked == 4
        async with harness(tiny_llama_dir, keys=False) as h:  # an open router: asked once
            for key in (None, "a", "b"):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                reply = await h.http.post(COMPLETIONS, json=body, headers=headers)
                assert reply.status_code == 200, reply.text
            assert h.gateway.callers.asked == 1

    run(test)


def test_an_oversize_prompt_is_400_naming_it_never_429(tiny_llama_dir: Path) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    words = " ".join(["sea"] * 3000)

    async def test() -> None:
        # The router's own max_prompt_tokens (ModelInfo), checked before sending.
        async with harness(tiny_llama_dir, max_prompt_tokens=100, max_body=1 << 20) as h:
            await h.gateway.admit(KEY)
            cases = [
                (CHAT, {"messages": [{"role": "user", "content": words}]}, "messages"),
                (COMPLETIONS, {"prompt": list(range(101))}, "prompt"),
                (COMPLETIONS, {"prompt": [[1, 2], list(range(200))]}, "prompt"),
            ]
            for path, body, param in cases:
                reply = await h.http.post(path, json=body, headers=auth)
                assert reply.status_code == 400, reply.text
                error = reply.json()["error"]
                assert (error["param"], error["code"]) == (param, "context_length_exceeded")
                assert "100" in error["message"] and error["message"].startswith(f"{param}: ")
            assert h.stub.calls["GenerateUnary"] == 0
            text = {"prompt": "x" * (16 * 8192 + 1)}  # the router's bytes per token of context
            reply = await h.http.post(COMPLETIONS, json=text, headers=auth)
            assert (reply.status_code, reply.json()["error"]["param"]) == (400, "prompt")
        # gRPC's own bound on the router's message: RESOURCE_EXHAUSTED, yet a 400.
        async with harness(tiny_llama_dir, max_receive_bytes=1024) as h:
            for path, body, param in [
                (CHAT, {"messages": [{"role": "user", "content": words}]}, "messages"),
                (COMPLETIONS, {"prompt": "sea " * 1000}, "prompt"),
            ]:
                for stream in (False, True):
                    reply = await h.http.post(path, json={**body, "stream": stream}, headers=auth)
                    assert reply.status_code == 400, reply.text
                    error = reply.json()["error"]
                    assert (error["param"], error["code"]) == (param, "context_length_exceeded")
                    assert "1024" in error["message"]

    run(test)


def test_a_large_body_is_prepared_on_a_worker_thread(tiny_llama_dir: Path) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)

    async def test() -> None:
        async with harness(tiny_llama_dir) as h:
            small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            big = {"messages": [{"role": "user", "content": "waves " * 2000}], "max_tokens": 1}
            for body in (small, big):
                reply = await h.http.post(CHAT, json=body, headers=auth)
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["message"]["content"] == "ok"
            counts = h.gateway.pool.counts
            assert (counts.inline, counts.pooled, counts.busy) == (1, 1, 0)
            # Tokenized on the thread as on the loop: the template's text, no BOS added.
            text = h.gateway.template.render([ChatMessage.model_validate(big["messages"][0])])
            expected = tokenizer.encode(text, add_bos=False)
            assert list(h.stub.requests[-1].token_ids.ids) == expected

    run(test)


def test_a_gateway_failure_is_an_openai_shaped_500(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def test() -> None:
        async with harness(tiny_llama_dir) as h:

            def broken(raw: bytes, router: object) -> None:
                raise RuntimeError("a bug")

            monkeypatch.setattr(h.gateway.preparer, "completion", broken)
            reply = await h.http.post(
                COMPLETIONS, json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}"}
            )
            assert reply.status_code == 500
            assert reply.headers["content-type"] == "application/json"
            error = reply.json()["error"]
            assert (error["type"], error["param"]) == ("server_error", None)
            assert "a bug" not in error["message"]

    run(test)
