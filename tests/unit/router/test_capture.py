"""Traffic capture: the record of a finished request, the router's follower of the setting
(against a real Redis), sampling, Redis failures, and the ``pdserve trace capture`` command.

Every wait polls its condition against a deadline; nothing is timed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from redis.asyncio import Redis

from pdserve.engine.block_manager import chain_block_hashes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError, PdServeError
from pdserve.redis_server import EmbeddedRedis
from pdserve.router import RequestFlow, RouteRequest
from pdserve.router.capture import (
    FIELD_CAPTURE,
    FIELD_HELLO,
    FIELD_RECORD,
    Capture,
    CaptureSetting,
    capture_record,
    capturing,
)
from pdserve.router.capture_cli import CaptureOptions, collect, main_capture, trace_lines
from pdserve.router.state import RequestState
from pdserve.router.text import ResponseText
from pdserve.router.trace import Clock, RequestTrace
from pdserve.scheduling.keys import KeySpace
from pdserve.scheduling.prefix_index import PromptBlocks
from pdserve.scheduling.registry import connect
from pdserve.tokenizer import Tokenizer
from tests.unit.router.test_flow import DECODED, Fakes, run_with_fakes

RECORD_KEYS = {
    "arrival_unix_s", "prompt_tokens", "output_tokens", "max_tokens", "tenant",
    "finish_reason", "block_size", "block_hashes",
}  # fmt: skip
DEAD_REDIS = "redis://127.0.0.1:1/0"
"""Nothing listens on port 1: every command fails at once."""


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def keys() -> KeySpace:
    """A namespace of the test's own in the shared Redis."""
    return KeySpace(f"t{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def _setting(**kw: Any) -> CaptureSetting:
    values: dict[str, Any] = {"id": uuid.uuid4().hex, "until": time.time() + 600}
    return CaptureSetting(**(values | kw))


def _request(n: int = 50, tenant: str = "acme", first: int = 31337) -> RouteRequest:
    return RouteRequest(
        "secret-request-id", tuple(range(first, first + n)), SamplingParams(max_tokens=64), tenant
    )


def _state(tokenizer: Tokenizer, request: RouteRequest) -> RequestState:
    """A request's state in the flow, as the flow makes it."""
    clock = Clock(None)
    return RequestState(request, clock, ResponseText(tokenizer, ()), RequestTrace(clock))


async def _until(probe: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)  # polling Redis: nothing to wait on


async def _entries(redis: Redis, keys: KeySpace) -> list[dict[str, str]]:
    raw: Any = await redis.xrange(keys.capture_stream)
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in raw]


async def _records(redis: Redis, keys: KeySpace) -> list[dict[str, Any]]:
    return [json.loads(e[FIELD_RECORD]) for e in await _entries(redis, keys) if FIELD_RECORD in e]


# -- the record --------------------------------------------------------------------------------


def test_the_record_holds_the_shape_and_the_schedulers_block_hashes() -> None:
    request = _request(50)
    record = capture_record(
        request, arrival_unix_s=1718000000.5, output_tokens=9, finish_reason="stop", block_size=16
    )
    assert set(record) == RECORD_KEYS
    assert (record["prompt_tokens"], record["output_tokens"], record["max_tokens"]) == (50, 9, 64)
    assert (record["tenant"], record["block_size"]) == ("acme", 16)
    scheduler = PromptBlocks(request.prompt_token_ids, "acme").hashes(16)
    assert record["block_hashes"] == [h.hex() for h in scheduler]
    # Full blocks of the prompt but its last token, salted with the tenant.
    ids = list(request.prompt_token_ids)
    assert len(record["block_hashes"]) == 3
    chained = chain_block_hashes(ids[:49], 16, salt="acme")
    assert record["block_hashes"] == [h.hex() for h in chained]
    other_tenant = capture_record(
        _request(50, tenant="other"), arrival_unix_s=0, output_tokens=1, finish_reason="stop",
        block_size=16,
    )  # fmt: skip
    assert not set(other_tenant["block_hashes"]) & set(record["block_hashes"])
    # Nothing of the content: no token id, no request id; only counts and hashes.
    assert "secret-request-id" not in json.dumps(record)
    assert all(len(h) == 32 and int(h, 16) >= 0 for h in record["block_hashes"])
    numbers = [v for k, v in record.items() if isinstance(v, int | float)]
    assert not set(numbers) & set(ids)


def test_a_request_that_failed_before_its_first_token_counts_one() -> None:
    record = capture_record(
        _request(5), arrival_unix_s=1.0, output_tokens=0, finish_reason="error", block_size=16
    )
    assert record["output_tokens"] == 1 and record["block_hashes"] == []


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('{"id": "a", "until": 1, "sample": 0}', "sample"),
        ('{"id": "a", "until": 1, "sample": 1.5}', "sample"),
        ('{"id": "a", "until": 1, "block_size": 0}', "block_size"),
        ('{"until": 1}', "capture"),
        ("not json", "capture"),
    ],
)
def test_bad_settings_are_refused(raw: str, field: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        CaptureSetting.from_json(raw)
    assert err.value.field == field


def test_the_setting_round_trips() -> None:
    setting = _setting(sample=0.5, block_size=32)
    assert CaptureSetting.from_json(setting.to_json()) == setting


# -- the router's follower ----------------------------------------------------------------------


def test_the_follower_turns_capture_on_and_off_and_says_hello(
    redis_url: str, keys: KeySpace
) -> None:
    async def main() -> None:
        redis = connect(redis_url)
        capture = Capture(redis, keys, poll_s=0.02, name="router-a")
        try:
            async with capturing(capture):
                assert capture.setting is None and capture.admit() is None
                setting = _setting()
                await redis.set(keys.capture, setting.to_json(), ex=60)

                async def on() -> bool:
                    return capture.setting == setting

                await _until(on, "capture on")
                assert capture.admit() is not None
                hellos = [e for e in await _entries(redis, keys) if FIELD_HELLO in e]
                assert hellos == [{FIELD_CAPTURE: setting.id, FIELD_HELLO: "router-a"}]
                await redis.delete(keys.capture)

                async def off() -> bool:
                    return capture.setting is None

                await _until(off, "capture off")
                assert capture.admit() is None
                # A setting past its end is off, an unreadable one too.
                await redis.set(keys.capture, _setting(until=time.time() - 1).to_json())
                await capture.refresh()
                assert capture.setting is None
                await redis.set(keys.capture, "{oops")
                await capture.refresh()
                assert capture.setting is None
        finally:
            await redis.aclose()

    asyncio.run(main())


def test_sampling_admits_its_share_and_all_at_one() -> None:
    capture = Capture(connect(DEAD_REDIS), KeySpace("x"), rng=random.Random(7).random)
    capture.setting = _setting(sample=0.25)
    admitted = sum(capture.admit() is not None for _ in range(4000))
    assert 800 < admitted < 1200
    calls = itertools.count()

    def counting() -> float:
        next(calls)
        return 0.99

    capture.rng = counting
    capture.setting = _setting(sample=1.0)
    assert all(capture.admit() is not None for _ in range(100))
    assert next(calls) == 0  # a full sample draws nothing


# -- through the flow ---------------------------------------------------------------------------


def test_finished_and_failed_requests_are_recorded_without_their_text(
    tokenizer: Tokenizer, redis_url: str, keys: KeySpace
) -> None:
    prompt = "hello secret words"

    def request(rid: str) -> RouteRequest:
        ids = tuple(tokenizer.encode(prompt))
        return RouteRequest(rid, ids, SamplingParams(max_tokens=4), tenant="acme")

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        redis = connect(redis_url)
        flow.capture = capture = Capture(redis, keys)
        capture.setting = _setting()
        try:
            got = [c async for c in flow.generate(request("ok"))]
            assert got[-1].finished
            fakes.decode_error = grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(PdServeError):
                _ = [c async for c in flow.generate(request("bad"))]
            await capture.write_pending()
            ok, failed = await _records(redis, keys)
            raw = json.dumps(await _entries(redis, keys))
        finally:
            await redis.aclose()
        ids = tokenizer.encode(prompt)
        assert ok["prompt_tokens"] == len(ids) and ok["output_tokens"] == 1 + len(DECODED)
        assert (ok["finish_reason"], ok["max_tokens"], ok["tenant"]) == ("length", 4, "acme")
        assert ok["block_hashes"] == [h.hex() for h in PromptBlocks(ids, "acme").hashes(16)]
        # The failed one streamed its first token only.
        assert (failed["finish_reason"], failed["output_tokens"]) == ("error", 1)
        assert "secret" not in raw and "ok" not in json.loads(raw)[0].values()

    run_with_fakes(tokenizer, lambda f: None, body)


def test_a_redis_outage_fails_no_request_and_is_logged_once(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pdserve.router.capture")

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        capture = Capture(connect(DEAD_REDIS), KeySpace("x"), poll_s=0.02)
        async with capturing(capture):
            flow.capture = capture
            capture.setting = _setting()  # as if read before the outage
            for i in range(3):
                req = RouteRequest(f"r{i}", (5, 6, 7), SamplingParams(max_tokens=4))
                got = [c async for c in flow.generate(req)]
                assert got[-1].finished and got[-1].usage is not None

                async def written(n: int = i + 1) -> bool:
                    return capture.dropped == n

                await _until(written, f"record {i} dropped")

    run_with_fakes(tokenizer, lambda f: None, body)
    drops = [r for r in caplog.records if "dropping captured records" in r.getMessage()]
    assert len(drops) == 1


def test_a_full_queue_drops_records_instead_of_growing(tokenizer: Tokenizer) -> None:
    capture = Capture(connect(DEAD_REDIS), KeySpace("x"), max_pending=1)
    capture.setting = _setting()
    req = _request(3)
    for _ in range(3):
        ticket = capture.admit()
        assert ticket is not None
        ticket.finished(_state(tokenizer, req), asyncio.CancelledError)
    assert capture.dropped == 2 and len(capture._pending) == 1
    assert capture._pending[0].finish_reason == "cancelled"


# -- the command ----------------------------------------------------------------------------------


def test_trace_lines_sort_by_arrival_from_the_first() -> None:
    records = [
        {"arrival_unix_s": 105.25, "prompt_tokens": 2, "output_tokens": 1},
        {"arrival_unix_s": 100.0, "prompt_tokens": 1, "output_tokens": 1},
    ]
    lines = [json.loads(line) for line in trace_lines(records)]
    assert [(r["arrival_s"], r["prompt_tokens"]) for r in lines] == [(0.0, 1), (5.25, 2)]
    assert all("arrival_unix_s" not in r for r in lines)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--duration", "0"], "--duration"),
        (["--duration", "-5"], "--duration"),
        (["--sample", "0"], "--sample"),
        (["--sample", "1.5"], "--sample"),
        (["--out", "/nonexistent-dir/trace.jsonl"], "--out"),
        (["--out", "."], "--out"),
        (["--max-records", "0"], "--max-records"),
        (["--redis-url", ""], "--redis-url"),
    ],
)
def test_the_command_refuses_bad_input_naming_the_flag(
    argv: list[str], flag: str, tmp_path: Path
) -> None:
    base = {"--redis-url": DEAD_REDIS, "--duration": "10", "--out": str(tmp_path / "t.jsonl")}
    base.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    with pytest.raises(InvalidArgumentError) as err:
        main_capture([x for kv in base.items() for x in kv])
    assert err.value.field == flag


def test_the_command_collects_what_the_routers_record(
    tokenizer: Tokenizer, redis_url: str, keys: KeySpace, tmp_path: Path
) -> None:
    opts = CaptureOptions(
        redis_url=redis_url, out=tmp_path / "t.jsonl", duration_s=60, namespace=keys.namespace,
        max_records=3, block_size=4,
    )  # fmt: skip
    said: list[str] = []

    async def main() -> None:
        redis = connect(redis_url)
        # A record of an earlier capture, in the stream before this one starts: not taken.
        await redis.xadd(keys.capture_stream, {FIELD_CAPTURE: "old", FIELD_RECORD: "{}"})
        router = Capture(redis, keys, poll_s=0.02, name="router-a")
        try:
            async with capturing(router):
                command = asyncio.create_task(collect(opts, said.append))

                async def greeted() -> bool:
                    return any("1 router" in line for line in said)

                await _until(greeted, "the router's hello")
                assert router.setting is not None and router.setting.block_size == 4
                for n in (9, 17, 5):  # prompt lengths
                    ticket = router.admit()
                    assert ticket is not None
                    run = _state(tokenizer, _request(n))
                    run.completion_tokens = n + 1
                    ticket.finished(run, None)
                captured = await asyncio.wait_for(command, 60)

                async def off() -> bool:
                    return await redis.get(keys.capture) is None

                await _until(off, "the setting cleared")
        finally:
            await redis.aclose()
        assert captured.routers == {"router-a"} and not captured.interrupted
        assert sorted(r["prompt_tokens"] for r in captured.records) == [5, 9, 17]
        assert all(r["output_tokens"] == r["prompt_tokens"] + 1 for r in captured.records)
        assert all(r["block_size"] == 4 for r in captured.records)

    asyncio.run(main())


def test_a_second_capture_is_refused_while_one_runs(
    redis_url: str, keys: KeySpace, tmp_path: Path
) -> None:
    async def main() -> None:
        redis = connect(redis_url)
        try:
            await redis.set(keys.capture, _setting().to_json(), ex=60)
            opts = CaptureOptions(
                redis_url=redis_url, out=tmp_path / "t.jsonl", duration_s=5,
                namespace=keys.namespace,
            )  # fmt: skip
            with pytest.raises(PdServeError, match="already running"):
                await collect(opts, lambda line: None)
        finally:
            await redis.aclose()

    asyncio.run(main())
