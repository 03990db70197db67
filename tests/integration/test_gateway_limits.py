"""The gateway's limits on a real cluster (``Cluster(http_port=0)``: uvicorn in its own
process): what a body may be, and the status of each way it is refused.

* a body over ``--max-body-bytes`` is a 413 in OpenAI's shape, from its ``Content-Length``
  before any byte of it is read, or while a chunked one streams, and the connection is closed
  without reading the rest;
* a lone surrogate in any string is a 400 naming where it is, never a plain-text 500;
* a boolean is no integer (``max_tokens: true``), and a chat role is one the gateway knows;
* a prompt longer than the model or the router takes is a 400 naming ``prompt`` or
  ``messages`` with the limit (``context_length_exceeded``), never a 429: retrying cannot
  help.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.launcher import Cluster

pytestmark = pytest.mark.integration

WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
               "--heartbeat-interval-s", "0.2")  # fmt: skip
MIB = 1024 * 1024
LIMIT = 16 * MIB
"""The gateway's default --max-body-bytes."""
WAIT_S = 60.0
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
WORDS = " ".join(["sea"] * 60_000)
"""The issue's 60,000-word prompt: far past the tiny model's 8192 tokens and the router's
message bound."""


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, redis_url: str) -> Iterator[Cluster]:
    with Cluster(tiny_llama_dir, redis_url=redis_url, namespace="gateway-limits",
                 worker_args=WORKER_ARGS, http_port=0) as c:  # fmt: skip
        yield c


def address(cluster: Cluster) -> tuple[str, int]:
    host, port = cluster.http_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def read_answer(conn: socket.socket, deadline_s: float = WAIT_S) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of the HTTP answer on ``conn`` (polled until ``deadline_s``); the
    connection must then be closed by the gateway."""
    conn.setblocking(False)
    data = b""
    deadline = time.monotonic() + deadline_s
    while True:
        assert time.monotonic() < deadline, f"no (whole) answer; got {data[:300]!r}"
        ready, _, _ = select.select([conn], [], [], 0.05)
        if not ready:
            continue
        try:
            chunk = conn.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:  # closed by the gateway: the answer is whole
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    return int(head.split()[1]), json.loads(body)


def assert_openai_error(body: dict[str, Any], code: str) -> dict[str, Any]:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", code)
    return dict(error)


def test_a_declared_length_over_the_limit_is_413_unread(cluster: Cluster) -> None:
    with socket.create_connection(address(cluster)) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200000000\r\n\r\n" + b'{"messages": [{"role": "user", "content": "'
        )  # the other 200 MB are never sent: the answer must not wait for them
        status, body = read_answer(conn)
    assert status == 413
    assert str(LIMIT) in assert_openai_error(body, "request_too_large")["message"]


def test_a_chunked_body_over_the_limit_is_413_while_it_streams(cluster: Cluster) -> None:
    chunk = b"a" * MIB
    sent = 0
    with socket.create_connection(address(cluster)) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        while sent < 64 * MIB:  # the end of the body is never sent
            ready, _, _ = select.select([conn], [], [], 0)
            if ready:
                break
            try:
                conn.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break  # closed after its answer, which is waiting to be read
            sent += len(chunk)
        status, body = read_answer(conn)
    assert status == 413
    assert_openai_error(body, "request_too_large")
    assert sent < 2 * LIMIT, "the gateway read far past its limit"


SURROGATES = [
    (COMPLETIONS, {"prompt": "\ud800"}, "prompt"),
    (COMPLETIONS, {"prompt": ["ok", "a\udfffb"]}, "prompt[1]"),
    (COMPLETIONS, {"prompt": "x", "stop": ["\ud800"]}, "stop[0]"),
    (COMPLETIONS, {"prompt": "x", "user": "\udc00"}, "user"),
    (CHAT, {"messages": [{"role": "user", "content": "sea\ud800"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]},
     "messages[0].name"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_the_field(
    cluster: Cluster, path: str, body: dict[str, Any], param: str
) -> None:
    raw = json.dumps({**body, "max_tokens": 2}).encode()  # the escape: "\ud800"
    reply = httpx.post(f"{cluster.http_url}{path}", content=raw, timeout=WAIT_S,
                       headers={"content-type": "application/json"})  # fmt: skip
    assert reply.status_code == 400, reply.text
    error = assert_openai_error(reply.json(), "invalid_value")
    assert error["param"] == param and "lone surrogate" in error["message"]


LOOSE = [
    (COMPLETIONS, {"prompt": "x", "max_tokens": True}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2, "n": True}, "n"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2, "seed": True}, "seed"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2, "logprobs": True}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2, "top_k": False}, "top_k"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2, "temperature": True}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "2"}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": True},
     "max_completion_tokens"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}], "max_tokens": 2},
     "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "function", "content": "x"}],
            "max_tokens": 2}, "messages[1].role"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), LOOSE)
def test_loose_types_and_unknown_roles_are_400(
    cluster: Cluster, path: str, body: dict[str, Any], param: str
) -> None:
    reply = httpx.post(f"{cluster.http_url}{path}", json=body, timeout=WAIT_S)
    assert reply.status_code == 400, reply.text
    error = assert_openai_error(reply.json(), "invalid_value")
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    if param.endswith(".role"):
        assert all(f"'{r}'" in error["message"] for r in ("system", "user", "assistant", "tool",
                                                           "developer"))  # fmt: skip


OVERSIZE = [
    (CHAT, {"messages": [{"role": "user", "content": WORDS}]}, "messages", str(16 * 8192)),
    (CHAT, {"messages": [{"role": "user", "content": WORDS[: 4 * 10_000]}]}, "messages", "8192"),
    (COMPLETIONS, {"prompt": WORDS}, "prompt", str(16 * 8192)),
    (COMPLETIONS, {"prompt": [5] * 9000}, "prompt", "8192"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body", "param", "limit"), OVERSIZE)
def test_an_oversize_prompt_is_400_naming_it_not_429(
    cluster: Cluster, path: str, body: dict[str, Any], param: str, limit: str, stream: bool
) -> None:
    reply = httpx.post(f"{cluster.http_url}{path}", timeout=WAIT_S,
                       json={**body, "max_tokens": 4, "stream": stream})  # fmt: skip
    assert reply.status_code == 400, reply.text
    error = assert_openai_error(reply.json(), "context_length_exceeded")
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    assert limit in error["message"]
