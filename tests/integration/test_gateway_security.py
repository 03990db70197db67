"""The HTTP gateway of a secured cluster: ``pdserve up --tls DIR --api-keys FILE
--router-client-auth`` on the tiny preset, driven by the official ``openai`` client.

* the gateway serves HTTPS with the cluster's certificate, and calls the router over TLS with
  the client certificate the router demands;
* each HTTP request's ``Authorization: Bearer KEY`` is the key of its router calls: a valid
  key gets the same tokens as the gRPC path with that key, a missing or wrong one is a 401
  (OpenAI's ``invalid_api_key``), ``/health`` needs none;
* ``/v1/models`` is gated alike (it asks the router's ``GetModelInfo`` with the caller's key),
  and ``Client.model_info`` names the key's tenant;
* the tenant is the key's: a tenant at its quota is refused (429 naming the quota) over HTTP
  and gRPC alike, while another key is served;
* a caller without a key is refused from the headers: an 8 MB chat body gets its 401 while it
  is still being sent (nothing of it read, parsed or tokenized), another caller is served
  meanwhile, and the whole body sent gets the 401 too (not the 429 of a router that was sent
  its tokens);
* the banner's curl command works as printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.client import AsyncClient, Client, Overloaded, TlsConfig, Unauthenticated
from pdserve.security.certs import ClusterCerts
from tests.integration.up_process import UpProcess, pdserve_up

pytestmark = pytest.mark.integration

KEYS = {tenant: f"k-{tenant}-{secrets.token_hex(12)}" for tenant in ("acme", "small")}
UP_ARGS = ("--port", "0", "--http-port", "0", "--router-client-auth",
           "--worker-arg=--dtype=float32", "--worker-arg=--threads=1",
           "--worker-arg=--kv-blocks=256")  # fmt: skip
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    """The directory ``pdserve up --tls`` fills (it makes the certificates)."""
    return ClusterCerts(tmp_path_factory.mktemp("gw-secured") / "tls")


@pytest.fixture(scope="module")
def up(
    tiny_llama_dir: Path, certs: ClusterCerts, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpProcess]:
    keys_file = certs.dir.parent / "keys.yaml"
    keys_file.write_text(
        "keys:\n"
        + "".join(f'  "{key}": {tenant}\n' for tenant, key in KEYS.items())
        + "tenants:\n  small: {max_reservations: 1}\n"
    )
    args = [*UP_ARGS, "--tls", str(certs.dir), "--api-keys", str(keys_file)]
    with pdserve_up(tiny_llama_dir, args, tmp_path_factory.mktemp("gw-secured-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def url(up: UpProcess) -> str:
    assert up.http_url is not None, "\n".join(up.banner)
    return up.http_url


def trusting(certs: ClusterCerts) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(certs.ca))


def oai(url: str, certs: ClusterCerts, key: str) -> openai.OpenAI:
    http = httpx.Client(verify=trusting(certs), timeout=60)
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, http_client=http)


def router_tls(certs: ClusterCerts) -> TlsConfig:
    """The router demands a client certificate (``--router-client-auth``)."""
    return TlsConfig(ca=certs.ca, cert=certs.client_cert, key=certs.client_key)


def hf_chat_ids(model_dir: Path) -> list[int]:
    """The chat prompt as ``transformers`` renders it (what the gateway must send)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def grpc_client(up: UpProcess, certs: ClusterCerts, tenant: str) -> Client:
    return Client(up.router, api_key=KEYS[tenant], tls=router_tls(certs), timeout=60)


def test_https_with_a_valid_key_gets_the_grpc_tokens(
    up: UpProcess, url: str, certs: ClusterCerts, tiny_llama_dir: Path
) -> None:
    assert url.startswith("https://127.0.0.1:")
    model = tiny_llama_dir.name
    with oai(url, certs, KEYS["acme"]) as c, grpc_client(up, certs, "acme") as g:
        expected = g.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
        done = c.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        (choice,) = done.choices
        assert choice.model_extra is not None
        assert choice.model_extra["token_ids"] == expected.token_ids
        assert (choice.text, choice.finish_reason) == (expected.text, "length")

        chat_ids = hf_chat_ids(tiny_llama_dir)
        expected = g.generate(chat_ids, max_tokens=10, temperature=0, ignore_eos=True)
        chunks = list(
            c.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=10, temperature=0,  # type: ignore[arg-type]
                stream=True, extra_body={"return_token_ids": True, "ignore_eos": True},
            )
        )  # fmt: skip
    deltas = [ch.choices[0] for ch in chunks[1:]]  # the first opens the choice (the role)
    assert [t for d in deltas for t in (d.model_extra or {})["token_ids"]] == expected.token_ids
    assert "".join(d.delta.content or "" for d in deltas) == expected.text
    # /health needs no key; the certificate is the cluster's, not one the system trusts.
    assert httpx.get(f"{url}/health", verify=trusting(certs)).json() == {"status": "ok"}
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_missing_key_is_401(url: str, certs: ClusterCerts, path: str, stream: bool) -> None:
    body = {"prompt": PROMPT, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "stream": stream}  # fmt: skip
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Basic abc"}):
        reply = httpx.post(
            f"{url}{path}", json=body, headers=headers, verify=trusting(certs), timeout=60
        )
        assert reply.status_code == 401, reply.text
        error = reply.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert "didn't provide an API key" in error["message"]


def test_a_wrong_key_is_401(url: str, certs: ClusterCerts, tiny_llama_dir: Path) -> None:
    wrong = "k-" + "0" * 30
    with oai(url, certs, wrong) as c, pytest.raises(openai.AuthenticationError) as refused:
        c.completions.create(model=tiny_llama_dir.name, prompt=PROMPT, max_tokens=4)
    assert refused.value.status_code == 401
    assert refused.value.code == "invalid_api_key"
    assert "Incorrect API key provided" in refused.value.message
    assert wrong not in refused.value.message  # the key is not echoed
    # A key gRPC metadata cannot carry is refused the same way, not a server error.
    reply = httpx.post(
        f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4},
        headers={"Authorization": "Bearer k-\xe9\xe9\xe9-0123456789abcdef".encode("latin-1")},
        verify=trusting(certs), timeout=60,
    )  # fmt: skip
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"


BIG_BODY = 8_000_000
"""The issue's unauthenticated chat body."""


def read_http_answer(conn: ssl.SSLSocket) -> tuple[int, dict[str, object]]:
    """Status and JSON body of one answer with a Content-Length (blocking reads, each bounded
    by the socket's timeout)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        body += conn.recv(65536)
    answer = json.loads(body)
    assert isinstance(answer, dict)
    return int(lines[0].split()[1]), answer


def test_no_key_is_401_before_the_body_is_read(
    url: str, certs: ClusterCerts, tiny_llama_dir: Path
) -> None:
    host, port = url.removeprefix("https://").rsplit(":", 1)
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
            f"Content-Type: application/json\r\nContent-Length: {BIG_BODY}\r\n\r\n")  # fmt: skip
    start = b'{"messages": [{"role": "user", "content": "' + b"sea " * 16_384
    with (
        socket.create_connection((host, int(port)), timeout=60) as raw,
        trusting(certs).wrap_socket(raw, server_hostname=host) as conn,
    ):
        conn.sendall(head.encode() + start)  # the rest of the 8 MB is not sent (yet)
        # Meanwhile another caller is served...
        with oai(url, certs, KEYS["acme"]) as c:
            done = c.chat.completions.create(
                model=tiny_llama_dir.name,
                messages=MESSAGES,
                max_tokens=2,  # type: ignore[arg-type]
            )
            assert done.choices[0].finish_reason == "length"
        # ...and this caller's 401 came from the headers: its body was never complete.
        status, answer = read_http_answer(conn)
    assert status == 401, answer
    error = answer["error"]
    assert isinstance(error, dict) and error["code"] == "invalid_api_key"


def test_a_whole_unauthenticated_8mb_chat_is_401(url: str, certs: ClusterCerts) -> None:
    content = "sea " * (BIG_BODY // 4)
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer k-" + "4" * 30}):
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers,
                           verify=trusting(certs), timeout=120)  # fmt: skip
        assert reply.status_code == 401, reply.text
        assert reply.json()["error"]["code"] == "invalid_api_key"


def test_models_needs_a_key(url: str, certs: ClusterCerts, tiny_llama_dir: Path) -> None:
    for headers in ({}, {"Authorization": "Bearer k-" + "2" * 30}):
        reply = httpx.get(f"{url}/v1/models", headers=headers, verify=trusting(certs), timeout=60)
        assert reply.status_code == 401, reply.text
        assert reply.json()["error"]["code"] == "invalid_api_key"
    with oai(url, certs, KEYS["acme"]) as c:
        assert [m.id for m in c.models.list().data] == [tiny_llama_dir.name]


def test_model_info_names_the_keys_tenant(
    up: UpProcess, certs: ClusterCerts, tiny_llama_dir: Path
) -> None:
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    with grpc_client(up, certs, "small") as g:
        info = g.model_info()
        assert info.tenant == "small"
        assert info.max_model_len == config["max_position_embeddings"]
        # The key of the call, not the client's, decides; no key is refused.
        assert g.model_info(api_key=KEYS["acme"]).tenant == "acme"
        with pytest.raises(Unauthenticated):
            g.model_info(api_key="k-" + "3" * 30)
    with (
        Client(up.router, tls=router_tls(certs), timeout=60) as anonymous,
        pytest.raises(Unauthenticated),
    ):
        anonymous.model_info()


def test_the_tenant_is_the_keys(
    up: UpProcess, url: str, certs: ClusterCerts, tiny_llama_dir: Path
) -> None:
    """``small`` may hold one reservation: while an HTTP stream of its key holds it, its next
    request is refused, over HTTP and over gRPC, and ``acme``'s is served."""
    model = tiny_llama_dir.name
    with (
        oai(url, certs, KEYS["small"]) as small,
        oai(url, certs, KEYS["acme"]) as acme,
        grpc_client(up, certs, "small") as small_grpc,
    ):
        held = small.completions.create(
            model=model, prompt=PROMPT, max_tokens=3500, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        with held:
            next(iter(held))  # its reservation is live while it streams
            with pytest.raises(openai.RateLimitError, match="max_reservations=1") as refused:
                small.completions.create(model=model, prompt=PROMPT, max_tokens=2)
            assert refused.value.status_code == 429
            with pytest.raises(Overloaded, match="max_reservations=1"):
                small_grpc.generate(PROMPT, max_tokens=2)
            served = acme.completions.create(model=model, prompt=PROMPT, max_tokens=2)
            assert served.choices[0].finish_reason == "length"
        deadline = time.monotonic() + 60
        while True:  # closing the stream cancels the request, which releases the reservation
            try:
                again = small.completions.create(model=model, prompt=PROMPT, max_tokens=2)
                assert again.choices[0].finish_reason == "length"
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the reservation was never released"
                time.sleep(0.05)  # polling: the release is not observable otherwise


def test_a_call_key_overrides_the_clients(up: UpProcess, certs: ClusterCerts) -> None:
    """``AsyncClient.generate/stream(api_key=...)``, as the gateway sends each caller's key."""

    async def body() -> None:
        wrong = "k-" + "1" * 30
        async with AsyncClient(up.router, api_key=wrong, tls=router_tls(certs)) as c:
            with pytest.raises(Unauthenticated):
                await c.generate(PROMPT, max_tokens=2)
            done = await c.generate(PROMPT, max_tokens=2, api_key=KEYS["acme"])
            assert done.finish_reason == "length"
            async with c.stream(PROMPT, max_tokens=2, api_key=KEYS["acme"]) as stream:
                assert [d async for d in stream][-1].finish_reason == "length"
            with pytest.raises(Unauthenticated):
                async with c.stream(PROMPT, max_tokens=2) as stream:
                    await anext(stream)
        async with AsyncClient(up.router, api_key=KEYS["acme"], tls=router_tls(certs)) as c:
            assert (await c.generate(PROMPT, max_tokens=2)).finish_reason == "length"

    asyncio.run(asyncio.wait_for(body(), 120))


def test_the_banners_curl_command_works(up: UpProcess, url: str, certs: ClusterCerts) -> None:
    (line,) = [ln.strip() for ln in up.banner if ln.strip().startswith(f"curl {url}/")]
    assert f"--cacert {certs.ca}" in line
    assert '-H "Authorization: Bearer $PDSERVE_API_KEY"' in line

    def run(key: str) -> dict[str, object]:
        env = {**os.environ, "PDSERVE_API_KEY": key}
        out = subprocess.run(
            ["bash", "-c", f"{line} --silent"], env=env, capture_output=True, text=True,
            timeout=120, check=True,
        )  # fmt: skip
        answer = json.loads(out.stdout)
        assert isinstance(answer, dict)
        return answer

    answer = run(KEYS["acme"])
    assert answer["object"] == "text_completion", answer
    refused = run("")["error"]
    assert isinstance(refused, dict)
    assert (refused["type"], refused["code"]) == ("invalid_request_error", "invalid_api_key")
