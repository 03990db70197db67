"""An OpenAI-compatible ``/v1/completions`` endpoint as a target (vLLM, SGLang, ...).

Each request is ``POST /v1/completions`` with ``{"model", "prompt": [token ids],
"max_tokens", "temperature": 0, "stream": true, "ignore_eos": true}`` and the target's
``features`` (``features``: a JSON schema, penalties), read as server-sent
events (``data: {...}`` per event, ``data: [DONE]`` last). Two fields of vLLM's say how many
tokens each event carries: ``return_token_ids`` (the event's token ids) and
``stream_options.continuous_usage_stats`` (a running ``usage.completion_tokens``); from a
server that sends neither, an event with text counts as one token. HTTP 429 is a rejection.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from pdserve_bench.serve.features import PLAIN, Features
from pdserve_bench.serve.targets import Chunk, RejectedError, TargetDownError, TargetError

CONNECT_TIMEOUT_S = 10.0
DONE = "[DONE]"


_EOL = re.compile(r"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The lines of an event stream as SSE ends them: CR LF, CR or LF, nothing else. (A
    generic line splitter also breaks at U+2028, U+0085, U+001C..., which JSON strings carry
    unescaped: a token's text would cut its event in two.)"""
    buf = ""
    async for text in chunks:
        buf += text
        while (m := _EOL.search(buf)) is not None:
            if m.group() == "\r" and m.end() == len(buf):
                break  # maybe the first half of CR LF: wait for the next chunk
            yield buf[: m.start()]
            buf = buf[m.end() :]
    if buf:
        yield buf.removesuffix("\r")


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined with newlines)."""
    data: list[str] = []
    async for line in lines:
        if not line:  # a blank line ends an event
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
        # comments (":...") and other fields (event:, id:, retry:) carry nothing we need
    if data:
        yield "\n".join(data)


def chunk_of(event: dict[str, Any], usage_seen: int) -> Chunk:
    """The tokens one decoded event carries; ``usage_seen``: the running usage count so far."""
    usage = event.get("usage") or {}
    usage_tokens = usage.get("completion_tokens")
    choices = event.get("choices") or []
    if not choices:
        return Chunk(None, 0, usage_tokens)
    choice = choices[0]
    ids = choice.get("token_ids")
    if ids is not None:
        return Chunk(tuple(ids), len(ids), usage_tokens)
    if usage_tokens is not None:
        return Chunk(None, usage_tokens - usage_seen, usage_tokens)
    return Chunk(None, 1 if choice.get("text") else 0, None)


class OpenAITarget:
    """``base_url``: ``http://host:port`` (a trailing ``/v1`` is accepted). ``model``: the
    served model's name; None asks ``GET /v1/models`` for the first one."""

    def __init__(self, base_url: str, label: str, *, model: str | None = None,
                 features: Features = PLAIN) -> None:  # fmt: skip
        self.features = features
        url = base_url.rstrip("/")
        self.base_url = url[: -len("/v1")] if url.endswith("/v1") else url
        self.label = label
        self.model = model
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            raise TargetDownError(f"{self.label}: not opened")
        return self._client

    async def open(self) -> None:
        # No pool limit: an open-loop client must never queue requests on its own side.
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        if self.model is not None:
            return
        try:
            resp = await self._client.get("/v1/models")
            resp.raise_for_status()
            self.model = str(resp.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
            raise TargetDownError(
                f"{self.label}: could not read the model name from {self.base_url}/v1/models "
                f"({type(e).__name__}: {e}); pass --openai-model"
            ) from e

    async def begin_point(self, rate: float | None) -> None:
        pass  # nothing to check beyond what each request finds out

    def body(self, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            **self.features.openai_fields(max_tokens),
        }

    async def stream(self, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[Chunk]:
        admitted = False
        try:
            request = self._http().stream(
                "POST", "/v1/completions", json=self.body(prompt, max_tokens)
            )
            async with request as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:300]
                    if resp.status_code == 429:
                        raise RejectedError(f"HTTP 429: {text}")
                    raise TargetError(f"HTTP {resp.status_code}: {text}", admitted=False)
                admitted = True
                usage_seen = 0
                async for data in sse_data(sse_lines(resp.aiter_text())):
                    if data == DONE:
                        return
                    try:
                        event = json.loads(data)
                    except json.JSONDecodeError as e:
                        raise TargetError(f"bad event {data[:100]!r}: {e}", admitted=True) from e
                    if "error" in event:
                        raise TargetError(f"error event: {event['error']}", admitted=True)
                    chunk = chunk_of(event, usage_seen)
                    usage_seen = chunk.usage_tokens or usage_seen
                    if chunk.tokens or chunk.usage_tokens is not None:
                        yield chunk
            raise TargetError(f"the stream ended without {DONE}", admitted=True)
        except httpx.HTTPError as e:
            raise TargetError(f"{type(e).__name__}: {e}", admitted=admitted) from e

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "openai", "url": self.base_url, "model": self.model,
            "features": self.features.name,
        }  # fmt: skip

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
