"""Fakes for ``bench serve``: a ``Target`` that answers at once and refuses a known share,
and a real HTTP server that streams OpenAI-style completions."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pdserve_bench.serve.features import PLAIN
from pdserve_bench.serve.targets import Chunk, RejectedError, TargetDownError

GRAMMAR_ENDS_AFTER = 3
"""Tokens of an answer to a request with ``response_format``: its grammar ends the answer."""


class FakeTarget:
    """Streams ``max_tokens`` one-token chunks at once. At a point of rate ``r`` it refuses
    ``floor(k * (1 - goodput(r)))`` of its first ``k`` requests, so a point of ``n`` requests
    has goodput exactly ``1 - floor(n * (1 - goodput(r))) / n``. Each answer token is the
    prompt's length (mod 1000), so a conversation's history can be checked."""

    features = PLAIN

    def __init__(
        self,
        label: str,
        goodput: Callable[[float | None], float] = lambda _r: 1.0,
        *,
        points_before_down: int | None = None,
    ) -> None:
        self.label = label
        self._goodput = goodput
        self._points_before_down = points_before_down
        self.rates: list[float | None] = []
        self.prompts: list[list[int]] = []
        self.opened = self.closed = False
        self._k = 0
        self._refuse = 0.0

    async def open(self) -> None:
        self.opened = True

    async def begin_point(self, rate: float | None) -> None:
        if self._points_before_down is not None and len(self.rates) >= self._points_before_down:
            raise TargetDownError(f"{self.label} went away")
        self.rates.append(rate)
        self._k = 0
        self._refuse = 1.0 - self._goodput(rate)

    async def stream(self, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[Chunk]:
        k = self._k
        self._k += 1
        self.prompts.append(list(prompt))
        if math.floor((k + 1) * self._refuse + 1e-9) > math.floor(k * self._refuse + 1e-9):
            raise RejectedError("RESOURCE_EXHAUSTED: fake is full")
        token = len(prompt) % 1000
        for i in range(max_tokens):
            yield Chunk((token,), 1, usage_tokens=i + 1)

    def describe(self) -> dict[str, Any]:
        return {"kind": "fake"}

    async def close(self) -> None:
        self.closed = True


class FakeOpenAI(ThreadingHTTPServer):
    """``mode``: ``token_ids`` (vLLM with return_token_ids), ``usage`` (running usage only),
    ``plain`` (text only), ``429``, ``500``, ``no-done``, ``error-event``. A request with
    ``response_format`` ends after ``GRAMMAR_ENDS_AFTER`` tokens, as a grammar would end it."""

    daemon_threads = True
    mode = "token_ids"
    bodies: list[dict[str, Any]]


class Handler(BaseHTTPRequestHandler):
    server: FakeOpenAI

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, code: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model"}]})
        else:
            self._json(404, {"error": "not found"})

    def _event(self, obj: Any) -> None:
        self.wfile.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        mode = self.server.mode
        if mode in ("429", "500"):
            self._json(int(mode), {"error": {"message": f"fake {mode}"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
        self.wfile.write(b": keep-alive comment\n\n")
        n, sent = body["max_tokens"], 0
        if "response_format" in body:
            n = min(n, GRAMMAR_ENDS_AFTER)
        while sent < n:
            step = 2 if sent == 1 and n - sent >= 2 else 1  # one event carries two tokens
            ids = [100 + sent + i for i in range(step)]
            sent += step
            choice: dict[str, Any] = {"index": 0, "text": "x" * step,
                                      "finish_reason": "length" if sent == n else None}  # fmt: skip
            event: dict[str, Any] = {"object": "text_completion", "choices": [choice]}
            if mode == "token_ids":
                choice["token_ids"] = ids
            if mode in ("token_ids", "usage"):
                event["usage"] = {"completion_tokens": sent}
            if mode == "error-event" and sent >= 2:
                self._event({"error": {"message": "engine died"}})
                return
            self._event(event)
        self._event({"choices": [], "usage": {"completion_tokens": n}})
        if mode != "no-done":
            self._event("[DONE]")


def url_of(srv: FakeOpenAI) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"
