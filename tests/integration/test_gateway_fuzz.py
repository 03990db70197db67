"""Fuzz the HTTP gateway with hypothesis: OpenAI-shaped bodies with mutated types, unicode
edges, sizes, missing and extra fields, sent to the gateway's app in this process in front of
a real cluster (router, scheduler, KV store, a prefill and a decode worker, Redis) whose
router demands an API key.

Every answer must be clean: never a 5xx; every 4xx in OpenAI's shape, a 400 naming its
parameter (``param``) unless it is about the body as a whole (``invalid_body``); a caller
without the key always a 401, with nothing of its body prepared; a body over
``--max-body-bytes`` a 413; a large body prepared on a worker thread, never on the event
loop; a 200 a whole answer (a stream ending in ``[DONE]``). A ticker task on the gateway's
event loop records the loop's longest stall, reported at the end (a figure, not an assertion:
on a loaded two-core machine the operating system alone can stall a thread that long).

``PDSERVE_FUZZ_EXAMPLES`` (default 150) sets the examples per endpoint; docs/robustness.md
has the figures of a long run.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings, target
from hypothesis import strategies as st

from pdserve.gateway import Gateway, GatewayConfig, create_app
from pdserve.gateway.body import BODY_CODE
from pdserve.gateway.pool import INLINE_BYTES
from pdserve.launcher import Cluster
from pdserve.models.demo import init_checkpoint

pytestmark = pytest.mark.integration

T = TypeVar("T")
EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "150"))
MAX_LEN = 96
"""max_position_embeddings of the checkpoint: every generation is short."""
MAX_BODY = 96 * 1024
"""The gateway's --max-body-bytes here: small, so that sizes cross it."""
KEY = "k-fuzz-0123456789abcdef"
MODEL = "fuzz-model"
WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "256",
               "--heartbeat-interval-s", "0.2")  # fmt: skip
CLEAN = {200, 400, 401, 404, 413, 429}
TICK_S = 0.005
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.large_base_example],
)  # fmt: skip


@dataclass
class Ticker:
    """The event loop's longest stall: a task that sleeps ``TICK_S`` and measures the
    oversleep."""

    worst_s: float = 0.0
    window_s: float = 0.0
    """The longest since ``window_s`` was last reset (one example)."""
    ticks: int = 0

    async def run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(TICK_S)
            late = time.perf_counter() - before - TICK_S
            self.worst_s = max(self.worst_s, late)
            self.window_s = max(self.window_s, late)
            self.ticks += 1


@dataclass
class Fuzzed:
    """The gateway app on its own event loop thread, in front of the cluster."""

    gateway: Gateway
    loop: asyncio.AbstractEventLoop
    http: httpx.AsyncClient
    ticker: Ticker = field(default_factory=Ticker)
    statuses: dict[int, int] = field(default_factory=dict)
    examples: int = 0
    stalls: list[tuple[float, str, int, int]] = field(default_factory=list)
    """The longest stalls during a request: (ms, path, body bytes, status), longest first."""

    def call(self, work: Awaitable[T], timeout_s: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def post(self, path: str, raw: bytes, key: str | None) -> httpx.Response:
        headers = {"content-type": "application/json"}
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        reply = self.call(self.http.post(path, content=raw, headers=headers))
        self.statuses[reply.status_code] = self.statuses.get(reply.status_code, 0) + 1
        self.examples += 1
        return reply


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    model = init_checkpoint(
        tmp_path_factory.mktemp("fuzz_http_model"), "tiny", dtype="float32",
        max_position_embeddings=MAX_LEN,
    )  # fmt: skip
    keys = tmp_path_factory.mktemp("fuzz_http_keys") / "keys.yaml"
    keys.write_text(f'keys:\n  "{KEY}": fuzz\n')
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="gateway-loop")
    thread.start()
    with Cluster(model, worker_args=WORKER_ARGS, log_level="WARNING", api_keys=keys) as c:
        config = GatewayConfig(router=c.router_address, model_dir=model, timeout_s=60,
                               served_model_name=MODEL, max_body_bytes=MAX_BODY)  # fmt: skip

        async def start() -> Fuzzed:
            gateway = Gateway.load(config)
            transport = httpx.ASGITransport(app=create_app(gateway))
            http = httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=100)
            return Fuzzed(gateway, loop, http)

        f = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
        ticking = asyncio.run_coroutine_threadsafe(f.ticker.run(), loop)
        try:
            yield f
        finally:
            ticking.cancel()
            f.call(f.http.aclose())
            f.call(f.gateway.close())
            counts = f.gateway.pool.counts
            print(f"\nHTTP fuzz: {f.examples} requests, statuses {sorted(f.statuses.items())}, "
                  f"bodies prepared inline {counts.inline}, on worker threads {counts.pooled}; "
                  f"longest event-loop stall {f.ticker.worst_s * 1000:.1f} ms over "
                  f"{f.ticker.ticks} ticks; during a request (ms, path, bytes, status): "
                  f"{[(round(ms, 1), *rest) for ms, *rest in f.stalls]}")  # fmt: skip
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()


# -- strategies ----------------------------------------------------------------------------------

LONE = ["\ud800", "\udfff", "a\udc00b"]
EDGES = ["", "a", "hello world", "\x00", "a\x00b", "\u202eevil\u202c", "🙂", "👩\u200d👩\u200d👧",
         "e\u0301", "\ufeff", "東京", "\U0010ffff", "\n\t\r", '"', "\\", "</s>", "<|im_start|>",
         "{% raise %}", "%s%n", *LONE]  # fmt: skip
TEXT = st.one_of(
    st.sampled_from(EDGES),
    st.text(max_size=30),
    st.text(st.characters(exclude_categories=()), max_size=8),  # surrogates included
)
LONG = st.builds(lambda t, n: t * n, st.sampled_from(["sea ", "é", "🙂", "{[", "a\ud800"]),
                 st.integers(1000, 40_000))  # fmt: skip
"""From a few KiB (worker threads) to past MAX_BODY (413)."""
WEIRD = st.one_of(
    st.none(), st.booleans(), TEXT,
    st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 2**31, 2**32, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(TEXT, st.integers(), max_size=2),
)  # fmt: skip
IDS = st.lists(st.one_of(st.integers(0, 2047), st.sampled_from([-1, 2048, 2**32])), max_size=40)


SAFE = st.one_of(
    st.sampled_from(["a", "hello world", "東京", "🙂", "e\u0301", "\u202eRTL"]),
    st.text(st.characters(codec="utf-8", min_codepoint=32), min_size=1, max_size=20),
)
"""Text the model takes (never a lone surrogate)."""
SAFE_IDS = st.lists(st.integers(0, 2047), min_size=1, max_size=40)
SAFE_LONG = st.builds(lambda t, n: t * n, st.sampled_from(["sea ", "東京", "{["]),
                      st.sampled_from([1100, 2000, 8000, 20_000, 30_000]))  # fmt: skip
"""Past the context (a 400 naming the prompt), on a worker thread, or past MAX_BODY (413)."""

# Per parameter: values that are valid, and any value at all.
COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2.5, 1e-320]),
    "top_p": st.sampled_from([0.1, 0.9, 1, 1.0]),
    "top_k": st.sampled_from([0, 1, 5, 2048, 2**32 - 1]),
    "n": st.sampled_from([1, 1, 2, 3]),
    "seed": st.sampled_from([0, 7, 2**63 - 1]),
    "stop": st.one_of(SAFE, st.lists(SAFE, max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": SAFE,
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 2047), max_size=4),
    "skip_special_tokens": st.booleans(),
    "return_token_ids": st.booleans(),
    "presence_penalty": st.just(0),
    "max_tokens": st.integers(1, 4),
}
COMPLETION_FIELDS = {**COMMON, "logprobs": st.integers(0, 1), "echo": st.just(False)}
TOOL = st.fixed_dictionaries({
    "type": st.sampled_from(["function", "function", "custom"]),
    "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g", "f", "no spaces", ""])},
        optional={"description": SAFE, "parameters": st.sampled_from([
            {"type": "object", "properties": {"x": {"type": "string", "maxLength": 3}}},
            {"type": "array"}, {}, {"type": "object", "properties": {"x": {"$ref": "#/nope"}}},
        ])},
    ),
})  # fmt: skip
TOOL_CHOICE = st.sampled_from(["none", "auto", "required", "maybe",
                               {"type": "function", "function": {"name": "f"}},
                               {"type": "function", "function": {"name": "h"}}])  # fmt: skip
CHAT_FIELDS = {**COMMON, "max_completion_tokens": st.integers(1, 4), "logprobs": st.booleans(),
               "top_logprobs": st.integers(0, 1), "add_generation_prompt": st.booleans(),
               "chat_template_kwargs": st.dictionaries(SAFE, SAFE, max_size=2),
               "tools": st.lists(TOOL, max_size=2), "tool_choice": TOOL_CHOICE,
               "parallel_tool_calls": st.booleans()}  # fmt: skip
VALID_PROMPT = st.one_of(SAFE, SAFE_IDS, SAFE_LONG, st.lists(SAFE, min_size=1, max_size=3),
                         st.lists(SAFE_IDS, min_size=1, max_size=2))  # fmt: skip
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": SAFE})
VALID_MESSAGES = st.lists(
    st.fixed_dictionaries({
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": st.one_of(SAFE, SAFE, SAFE_LONG, st.lists(TEXT_PART, max_size=2)),
    }),
    min_size=1, max_size=3,
)  # fmt: skip
PROMPT = st.one_of(TEXT, LONG, IDS, st.lists(TEXT, max_size=4), st.lists(IDS, max_size=3), WEIRD)
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""])},
                             optional={"text": st.one_of(TEXT, WEIRD)})  # fmt: skip
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "robot", "tool"]),
                           WEIRD)},
        optional={"content": st.one_of(TEXT, LONG, st.lists(PART, max_size=3), WEIRD),
                  "name": st.one_of(TEXT, WEIRD), "tool_call_id": st.one_of(TEXT, WEIRD),
                  "tool_calls": st.one_of(WEIRD, st.lists(st.fixed_dictionaries({
                      "type": st.just("function"), "function": st.fixed_dictionaries(
                          {"name": TEXT, "arguments": st.one_of(TEXT, WEIRD, st.just("{}"))}),
                  }), max_size=2))},
    ),
    WEIRD,
)  # fmt: skip
MESSAGES = st.one_of(st.lists(MESSAGE, max_size=4), WEIRD)
EXTRA = st.dictionaries(TEXT, WEIRD, max_size=2)
"""Unknown fields (refused by name) or known ones with any value."""


@st.composite
def bodies(
    draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]], required: str,
    valid: st.SearchStrategy[Any], wild: st.SearchStrategy[Any],
) -> dict[str, Any]:  # fmt: skip
    """A valid body; the same with one parameter set to anything (or the required one left
    out); or every parameter anything, with extra fields."""
    names = sorted(fields)
    body = draw(st.fixed_dictionaries({required: valid}, optional=fields))
    how = draw(st.sampled_from(["valid", "one", "one", "wild"]))
    if how == "one":
        name = draw(st.sampled_from([required, *names]))
        body[name] = draw(st.one_of(WEIRD, wild if name == required else WEIRD))
        if draw(st.booleans()) and name == required:
            del body[required]
    elif how == "wild":
        anything = {k: draw(st.one_of(WEIRD, fields[k])) for k in body if k != required}
        body = {**draw(EXTRA), **anything, required: draw(wild)}
    return body


COMPLETIONS = bodies(COMPLETION_FIELDS, "prompt", VALID_PROMPT, PROMPT)
CHATS = bodies(CHAT_FIELDS, "messages", VALID_MESSAGES, MESSAGES)
KEYS = st.sampled_from([KEY] * 8 + [None, "k-wrong-0123456789abcdef"])


@st.composite
def encoded(draw: st.DrawFn, body: Any) -> bytes:
    """``body`` as bytes a client may send: ASCII JSON (a lone surrogate as its escape), UTF-8
    JSON (a lone surrogate as its invalid bytes), cut short, or not JSON at all."""
    how = draw(st.sampled_from(["ascii"] * 6 + ["utf8", "utf8", "cut", "bytes"]))
    if how == "bytes":
        return draw(st.binary(max_size=64))
    text = json.dumps(body, ensure_ascii=how != "utf8")
    raw = text.encode("utf-8", "surrogatepass")
    return raw[: draw(st.integers(0, len(raw)))] if how == "cut" else raw


# -- the property --------------------------------------------------------------------------------


def check(f: Fuzzed, path: str, raw: bytes, key: str | None) -> None:
    pooled = f.gateway.pool.counts.pooled
    prepared = pooled + f.gateway.pool.counts.inline
    f.ticker.window_s = 0.0
    reply = f.post(path, raw, key)
    stall_ms = f.ticker.window_s * 1000
    target(stall_ms, label="event-loop stall (ms)")  # steer towards stalls
    f.stalls = sorted([*f.stalls, (stall_ms, path, len(raw), reply.status_code)], reverse=True)[:5]
    status, what = (
        reply.status_code,
        f"{reply.status_code} {reply.text[:300]!r}\nbody {raw[:300]!r}",
    )
    assert status in CLEAN, what
    counts = f.gateway.pool.counts
    if key != KEY:
        assert status == 401, what  # from the headers: nothing of the body prepared
        assert counts.pooled + counts.inline == prepared, what
    elif len(raw) > MAX_BODY:
        assert status == 413, what
    # A large body is prepared on a worker thread, a small one inline: never both, never twice.
    big = key == KEY and INLINE_BYTES < len(raw) <= MAX_BODY
    assert counts.pooled - pooled == (1 if big else 0), what
    if status >= 400:
        assert reply.headers["content-type"] == "application/json", what
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, what
        assert isinstance(error["message"], str) and error["message"], what
        assert error["type"] in ("invalid_request_error", "not_found_error", "rate_limit_error")
        if status == 400:
            assert error["param"] or error["code"] == BODY_CODE, what
            assert error["param"] is None or error["message"].startswith(f"{error['param']}: ")
        return
    if reply.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in reply.text.split("\n") if line]
        assert events[-1] == "data: [DONE]", what
        for event in events[:-1]:
            chunk = json.loads(event.removeprefix("data: "))
            assert "error" not in chunk, what
    else:
        assert reply.json()["choices"], what


@FUZZ
@given(body=COMPLETIONS, data=st.data(), key=KEYS)
@example(body={"prompt": "\ud800"}, data=None, key=KEY)
@example(body={"prompt": "x", "max_tokens": True}, data=None, key=KEY)
@example(body={"prompt": "sea " * 30_000}, data=None, key=None)
@example(body={"prompt": "sea " * 2000, "max_tokens": 1}, data=None, key=KEY)
def test_completions(
    fuzzed: Fuzzed, body: Any, data: st.DataObject | None, key: str | None
) -> None:
    raw = data.draw(encoded(body)) if data is not None else json.dumps(body).encode()
    check(fuzzed, "/v1/completions", raw, key)


@FUZZ
@given(body=CHATS, data=st.data(), key=KEYS)
@example(body={"messages": [{"role": "user", "content": "a\udc00"}]}, data=None, key=KEY)
@example(body={"messages": [{"role": "robot", "content": "hi"}]}, data=None, key=KEY)
@example(body={"": "\ud800", "messages": []}, data=None, key=KEY)  # found by a long run
@example(body={"messages": [{"role": "user", "content": "sea " * 30_000}]}, data=None, key=None)
@example(body={"messages": [{"role": "user", "content": "waves " * 1000}], "max_tokens": 2},
         data=None, key=KEY)  # fmt: skip
def test_chat(fuzzed: Fuzzed, body: Any, data: st.DataObject | None, key: str | None) -> None:
    raw = data.draw(encoded(body)) if data is not None else json.dumps(body).encode()
    check(fuzzed, "/v1/chat/completions", raw, key)
