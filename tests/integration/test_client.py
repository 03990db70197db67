"""The client SDK against a scripted in-process Router server.

The fake server answers each call as its script says (fail with a status before any chunk,
stream chunks, fail mid-stream, hang until cancelled), so that retries, error types, metadata
and cancellation are checked exactly, without workers.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.client import (
    DEFAULT_TIMEOUT_S,
    AsyncClient,
    Cancelled,
    Client,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    Overloaded,
    PdServeClientError,
    RequestTooLarge,
    RetryPolicy,
    ServerError,
    Unavailable,
)
from pdserve.client.cli import main_generate
from pdserve.rpc.sizes import MAX_MESSAGE_BYTES
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.integration

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.002)
TOKENS = [11, 12, 13]
TEXTS = ["a", "bc", "d"]
HANG_S = 60.0
"""How long a hanging call waits for the client to end it: longer than any test waits for
``FakeRouter.cancelled`` (10 s), so that only the client's cancel (or deadline) sets it."""


@dataclass
class Step:
    """What the fake server does on one call."""

    fail: grpc.StatusCode | None = None
    message: str = "scripted failure"
    chunks_before_fail: int = 0
    hang: bool = False
    """Send one chunk, then wait until the client cancels (or HANG_S pass)."""


@dataclass
class FakeRouter(router_pb2_grpc.RouterServicer):
    script: deque[Step] = field(default_factory=deque)
    requests: list[router_pb2.GenerateRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    time_left: list[float | None] = field(default_factory=list)
    """The deadline each call arrived with, in seconds left (None: no deadline)."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _record(self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext) -> Step:
        with self.lock:
            self.requests.append(request)
            self.metadata.append({k: v for k, v in context.invocation_metadata()})
            self.time_left.append(context.time_remaining())
            return self.script.popleft() if self.script else Step()

    def _chunks(self) -> list[router_pb2.GenerateChunk]:
        chunks = [
            router_pb2.GenerateChunk(token_ids=[t], text=s, logprobs=[-0.5])
            for t, s in zip(TOKENS, TEXTS, strict=True)
        ]
        chunks[0].request_id = "rid-1"
        last = chunks[-1]
        last.finish_reason = common_pb2.FINISH_REASON_LENGTH
        last.usage.CopyFrom(common_pb2.Usage(prompt_tokens=4, completion_tokens=3, cached_tokens=1))
        last.timing.CopyFrom(common_pb2.Timing(ttft_ms=1.0, e2e_ms=2.0, transport="store"))
        return chunks

    def Generate(  # noqa: N802
        self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[router_pb2.GenerateChunk]:
        step = self._record(request, context)
        chunks = self._chunks()
        if step.hang:
            context.add_callback(self.cancelled.set)
            yield chunks[0]
            self.cancelled.wait(HANG_S)
            return
        if step.fail is not None:
            yield from chunks[: step.chunks_before_fail]
            context.abort(step.fail, step.message)
        yield from chunks

    def GenerateUnary(  # noqa: N802
        self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> router_pb2.GenerateResponse:
        step = self._record(request, context)
        if step.hang:
            context.add_callback(self.cancelled.set)
            self.cancelled.wait(HANG_S)
            return router_pb2.GenerateResponse()
        if step.fail is not None:
            context.abort(step.fail, step.message)
        last = self._chunks()[-1]
        return router_pb2.GenerateResponse(
            text="".join(TEXTS),
            token_ids=TOKENS,
            logprobs=[-0.5] * 3,
            finish_reason=last.finish_reason,
            usage=last.usage,
            timing=last.timing,
            request_id="rid-1",
        )


@pytest.fixture
def fake() -> Iterator[tuple[FakeRouter, str]]:
    servicer = FakeRouter()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        servicer.cancelled.set()  # release a handler still waiting
        server.stop(None)


class CallCounter(grpc.ServerInterceptor):
    """Counts the calls that reach the server, those whose message it refuses included."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        self.methods.append(details.method)
        return continuation(details)


SMALL_RECEIVE_BYTES = 1024


@pytest.fixture
def small() -> Iterator[tuple[CallCounter, str]]:
    """A router whose gRPC receive limit is SMALL_RECEIVE_BYTES, counting the calls."""
    counter = CallCounter()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        interceptors=[counter],
        options=[("grpc.max_receive_message_length", SMALL_RECEIVE_BYTES)],
    )
    router_pb2_grpc.add_RouterServicer_to_server(FakeRouter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield counter, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@pytest.mark.parametrize("how", ["generate", "stream", "async generate", "async stream"])
def test_a_message_over_the_routers_receive_limit_is_not_overload_and_not_retried(
    small: tuple[CallCounter, str], how: str
) -> None:
    counter, address = small
    prompt = "word " * SMALL_RECEIVE_BYTES
    retry = RetryPolicy(max_attempts=5, initial_backoff_s=0.001, max_backoff_s=0.002)

    async def run_async() -> None:
        async with AsyncClient(address, retry=retry) as client:
            if how == "async generate":
                await client.generate(prompt)
            else:
                async for _ in client.stream(prompt):
                    pass

    with pytest.raises(RequestTooLarge) as info:
        if how.startswith("async"):
            asyncio.run(run_async())
        else:
            with Client(address, retry=retry) as client:
                if how == "generate":
                    client.generate(prompt)
                else:
                    list(client.stream(prompt))
    assert isinstance(info.value, InvalidRequest) and not isinstance(info.value, Overloaded)
    assert info.value.field == "prompt"
    assert f"the router takes {SMALL_RECEIVE_BYTES} at most" in info.value.message
    assert len(counter.methods) == 1  # one call, no retry


def test_a_message_over_the_clients_send_limit_is_refused_before_it_is_sent(
    small: tuple[CallCounter, str],
) -> None:
    _, address = small
    with Client(address) as client, pytest.raises(RequestTooLarge) as info:
        client.generate("x" * MAX_MESSAGE_BYTES)
    assert info.value.field == "prompt"
    assert f"this client sends {MAX_MESSAGE_BYTES} at most" in info.value.message


def test_generate_builds_the_request_and_reads_the_response(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    with Client(address, tenant="team-a") as client:
        done = client.generate(
            [5, 6, 7], max_tokens=3, temperature=0, top_k=4, seed=9, stop=["x"],
            stop_token_ids=[2], ignore_eos=True, request_id="mine", tenant="team-b",
        )  # fmt: skip
    assert done.text == "abcd" and done.token_ids == TOKENS and done.finish_reason == "length"
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.cached_tokens) == (4, 1)
    assert done.timing is not None and done.timing.transport == "store"
    (request,) = servicer.requests
    assert list(request.token_ids.ids) == [5, 6, 7] and request.request_id == "mine"
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.seed) == (3, 0.0, 4, 9)
    assert list(s.stop) == ["x"] and list(s.stop_token_ids) == [2] and s.ignore_eos
    assert not s.HasField("top_p")  # unset: the server's default applies
    assert request.skip_special_tokens
    assert servicer.metadata[0]["x-pdserve-tenant"] == "team-b"  # per call beats the default


def test_logits_controls_travel_under_their_names(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    with Client(address) as client:
        client.generate(
            "hi", presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, min_p=0.1,
            min_tokens=3, logit_bias={7: 100, 8: -2.5}, allowed_token_ids=[7, 8, 9],
            bad_words=["gosh"], bad_words_token_ids=[[4], [5, 6]],
        )  # fmt: skip
        client.generate("hi", repetition_penalty=None)
    controlled, plain = (r.sampling for r in servicer.requests)
    assert (controlled.presence_penalty, controlled.frequency_penalty) == (0.5, -1.0)
    assert controlled.repetition_penalty == pytest.approx(1.2)
    assert controlled.min_p == pytest.approx(0.1) and controlled.min_tokens == 3
    assert dict(controlled.logit_bias) == {7: 100.0, 8: -2.5}
    assert list(controlled.allowed_token_ids) == [7, 8, 9]
    assert list(controlled.bad_words) == ["gosh"]
    assert [list(w.ids) for w in controlled.bad_words_token_ids] == [[4], [5, 6]]
    assert not plain.HasField("repetition_penalty")  # unset: the server's default (1, off)
    assert (plain.min_tokens, plain.min_p, len(plain.logit_bias)) == (0, 0.0, 0)


def test_guides_travel_under_their_vllm_names(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    schema = {"type": "object", "properties": {"é": {"type": "integer"}}}
    with Client(address) as client:
        client.generate("hi", guided_json=schema)
        client.generate("hi", guided_json='{"type": "string"}')
        client.generate("hi", guided_json_object=True)
        client.generate("hi", guided_regex="[a-z]+")
        client.generate("hi", guided_choice=["yes", "no"])
        client.generate("hi", guided_grammar='root ::= "x"')
        client.generate("hi", guided_json_object=False, guided_json=None)
    by_dict, by_text, obj, regex, choice, grammar, plain = (r.sampling for r in servicer.requests)
    assert json.loads(by_dict.guided_json) == schema and by_text.guided_json == '{"type": "string"}'
    assert obj.guided_json_object and regex.guided_regex == "[a-z]+"
    assert list(choice.guided_choice) == ["yes", "no"] and grammar.guided_grammar == 'root ::= "x"'
    assert not [f for f, _ in plain.ListFields() if f.name.startswith("guided_")]


def test_every_call_has_the_default_deadline_unless_told_otherwise(
    fake: tuple[FakeRouter, str],
) -> None:
    servicer, address = fake
    with Client(address) as client:
        client.generate("a")
        list(client.stream("b"))
        client.generate("c", timeout=5)
    with Client(address, timeout=None) as unlimited:
        list(unlimited.stream("d"))
    default, streamed, given, none = servicer.time_left
    # (gRPC carries a deadline rounded up a little.)
    for left in (default, streamed):
        assert left is not None and DEFAULT_TIMEOUT_S - 10 < left <= DEFAULT_TIMEOUT_S + 1
    assert given is not None and 0 < given <= 6
    assert none is None or none > 1e9  # the sync server says "no deadline" so
    with pytest.raises(ValueError, match="timeout"):
        Client(address, timeout=0)


def test_a_stalled_stream_ends_at_its_deadline(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.script.append(Step(hang=True))
    with Client(address, timeout=0.5) as client, pytest.raises(DeadlineExceeded):
        for _ in client.stream("hi"):  # one chunk, then nothing
            pass
    assert servicer.cancelled.wait(10)  # the server saw the call end


def test_unset_options_stay_unset(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    with Client(address) as client:
        client.generate("hi")
    (request,) = servicer.requests
    assert request.text == "hi" and not request.HasField("request_id")
    for name in ("temperature", "top_p", "seed", "max_tokens"):
        assert not request.sampling.HasField(name)
    assert "x-pdserve-tenant" not in servicer.metadata[0]


def test_stream_yields_deltas_and_sums_them(fake: tuple[FakeRouter, str]) -> None:
    _, address = fake
    with Client(address) as client, client.stream("hi") as stream:
        deltas = list(stream)
        done = stream.completion()
    assert [d.text for d in deltas] == TEXTS
    assert deltas[0].request_id == "rid-1" and not deltas[0].finished
    assert deltas[-1].finish_reason == "length" and deltas[-1].usage is not None
    assert done.text == "".join(TEXTS) and done.token_ids == TOKENS and done.request_id == "rid-1"


@pytest.mark.parametrize("streaming", [False, True])
def test_unavailable_before_the_first_token_is_retried(
    fake: tuple[FakeRouter, str], streaming: bool
) -> None:
    servicer, address = fake
    servicer.script.extend([Step(grpc.StatusCode.UNAVAILABLE), Step(grpc.StatusCode.UNAVAILABLE)])
    with Client(address, retry=FAST_RETRY) as client:
        if streaming:
            tokens = [t for d in client.stream("hi") for t in d.token_ids]
        else:
            tokens = client.generate("hi").token_ids
    assert tokens == TOKENS
    assert len(servicer.requests) == 3


def test_retries_are_bounded(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.script.extend([Step(grpc.StatusCode.UNAVAILABLE, "worker gone")] * 5)
    with Client(address, retry=FAST_RETRY) as client, pytest.raises(Unavailable) as info:
        client.generate("hi")
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and info.value.message == "worker gone"
    assert len(servicer.requests) == FAST_RETRY.max_attempts


def test_no_retry_once_a_token_has_arrived(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.script.append(Step(grpc.StatusCode.UNAVAILABLE, chunks_before_fail=1))
    received = []
    with Client(address, retry=FAST_RETRY) as client, pytest.raises(Unavailable):
        for delta in client.stream("hi"):
            received.append(delta)
    assert [d.token_ids for d in received] == [TOKENS[:1]]
    assert len(servicer.requests) == 1


@pytest.mark.parametrize(
    ("code", "error_type"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.INTERNAL, ServerError),
        (grpc.StatusCode.FAILED_PRECONDITION, ServerError),
    ],
)
def test_status_codes_map_to_typed_errors_without_retry(
    fake: tuple[FakeRouter, str], code: grpc.StatusCode, error_type: type[PdServeClientError]
) -> None:
    servicer, address = fake
    servicer.script.append(Step(code, "sampling.top_p: must be in (0, 1], got 0"))
    with Client(address, retry=FAST_RETRY) as client, pytest.raises(error_type) as info:
        client.generate("hi")
    assert isinstance(info.value, PdServeClientError)
    assert info.value.code is code
    assert info.value.message == "sampling.top_p: must be in (0, 1], got 0"
    if isinstance(info.value, InvalidRequest):
        assert info.value.field == "sampling.top_p"
    assert len(servicer.requests) == 1


def test_client_side_checks_send_nothing(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    with Client(address) as client:
        for kwargs, field_name in [
            ({"max_tokens": -1}, "sampling.max_tokens"),
            ({"top_k": 2**32}, "sampling.top_k"),
            ({"seed": -3}, "sampling.seed"),
            ({"stop_token_ids": [1, -1]}, "sampling.stop_token_ids"),
            ({"min_tokens": -1}, "sampling.min_tokens"),
            ({"logit_bias": {-1: 1.0}}, "sampling.logit_bias"),
            ({"allowed_token_ids": [2**32]}, "sampling.allowed_token_ids"),
            ({"bad_words_token_ids": [[1], [True]]}, "sampling.bad_words_token_ids"),
            ({"guided_json": {"a": object()}}, "sampling.guided_json"),  # not JSON
            ({"guided_choice": "yes"}, "sampling.guided_choice"),  # one string, not a list
            ({"guided_regex": "a", "guided_choice": ["a"]}, "sampling.guided_choice"),
        ]:
            with pytest.raises(InvalidRequest) as info:
                client.generate("hi", **kwargs)  # type: ignore[arg-type]
            assert info.value.field == field_name
        with pytest.raises(InvalidRequest) as info:
            client.generate([1, -2])
        assert info.value.field == "token_ids"
        with pytest.raises(InvalidRequest) as info:
            client.generate(3.5)  # type: ignore[arg-type]
        assert info.value.field == "prompt"
    assert servicer.requests == []


def test_deadline_applies_to_the_whole_call(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.script.append(Step(hang=True))
    with Client(address) as client, pytest.raises(DeadlineExceeded):
        client.generate("hi", timeout=1.0)  # long enough to reach the server under load
    assert servicer.cancelled.wait(10)


def test_unreachable_router_is_unavailable_after_bounded_retries() -> None:
    # A port nobody listens on: the connection is refused at once.
    with Client("127.0.0.1:1", retry=FAST_RETRY) as client, pytest.raises(Unavailable):
        client.generate("hi", timeout=10)


def test_async_client_generate_stream_and_retry(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.script.append(Step(grpc.StatusCode.UNAVAILABLE))

    async def run() -> tuple[Any, list[Any]]:
        async with AsyncClient(address, retry=FAST_RETRY, tenant="t1") as client:
            done = await client.generate("hi", max_tokens=3)
            deltas = [d async for d in client.stream("hi")]
        return done, deltas

    done, deltas = asyncio.run(run())
    assert done.token_ids == TOKENS and [d.text for d in deltas] == TEXTS
    assert len(servicer.requests) == 3  # one retried unary call, then the stream
    assert all(md["x-pdserve-tenant"] == "t1" for md in servicer.metadata)


def test_async_errors_are_typed(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.script.extend(
        [
            Step(grpc.StatusCode.RESOURCE_EXHAUSTED),
            Step(grpc.StatusCode.INVALID_ARGUMENT, "text: empty"),
        ]
    )

    async def run() -> None:
        async with AsyncClient(address, retry=FAST_RETRY) as client:
            with pytest.raises(Overloaded):
                await client.generate("hi")
            with pytest.raises(InvalidRequest) as info:
                async for _ in client.stream("hi"):
                    pass
            assert info.value.field == "text"

    asyncio.run(run())
    assert len(servicer.requests) == 2


@pytest.mark.parametrize("how", ["exit", "cancel"])
def test_async_stream_cancel_reaches_the_server(fake: tuple[FakeRouter, str], how: str) -> None:
    servicer, address = fake
    servicer.script.append(Step(hang=True))

    async def run() -> list[Any]:
        got = []
        async with AsyncClient(address) as client:
            if how == "exit":
                async with client.stream("hi") as stream:
                    async for delta in stream:
                        got.append(delta)
                        break
            else:
                stream = client.stream("hi")
                with pytest.raises(Cancelled):
                    async for delta in stream:
                        got.append(delta)
                        stream.cancel()
        return got

    got = asyncio.run(run())
    assert [d.token_ids for d in got] == [TOKENS[:1]]
    assert servicer.cancelled.wait(10), "the server never saw the cancellation"


def test_sync_stream_cancel_reaches_the_server(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.script.append(Step(hang=True))
    with Client(address) as client:
        stream = client.stream("hi")
        first = next(iter(stream))
        assert first.token_ids == TOKENS[:1]
        stream.cancel()
        with pytest.raises(Cancelled):
            next(stream)
    assert servicer.cancelled.wait(10)


def test_sync_break_out_of_a_for_loop_cancels_the_call(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.script.append(Step(hang=True))
    with Client(address) as client:
        stream = client.stream("hi")  # still referenced after the loop
        for delta in stream:
            assert delta.token_ids == TOKENS[:1]
            break
        assert servicer.cancelled.wait(10), "the server never saw the cancellation"
        with pytest.raises(Cancelled):  # reading on after the break: the call is over
            next(stream)
        assert stream.completion().token_ids == TOKENS[:1]


def test_async_break_out_of_an_async_for_loop_cancels_the_call(
    fake: tuple[FakeRouter, str],
) -> None:
    servicer, address = fake
    servicer.script.append(Step(hang=True))

    async def run() -> bool:
        async with AsyncClient(address) as client:
            stream = client.stream("hi")  # still referenced after the loop, never closed
            async for _ in stream:
                break
            # The event loop closes the dropped iterator, which cancels the call.
            return await asyncio.to_thread(servicer.cancelled.wait, 10)

    assert asyncio.run(run()), "the server never saw the cancellation"


def test_a_dropped_stream_cancels_its_call(fake: tuple[FakeRouter, str]) -> None:
    servicer, address = fake
    servicer.script.append(Step(hang=True))
    with Client(address) as client:
        stream = client.stream("hi")
        assert next(stream).token_ids == TOKENS[:1]
        del stream  # no reference cycle: collected at once, without the garbage collector
        assert servicer.cancelled.wait(10), "the server never saw the cancellation"


def test_the_generate_command_sends_its_sampling_and_structured_output_flags(
    fake: tuple[FakeRouter, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    servicer, address = fake
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer"}}}')
    base = ["hi", "--router", address, "--max-tokens", "3"]
    assert main_generate([*base, "--json-schema", f"@{schema}", "--min-p", "0.1",
                          "--presence-penalty", "0.5", "--frequency-penalty", "-1",
                          "--repetition-penalty", "1.2", "--min-tokens", "2"]) == 0  # fmt: skip
    assert main_generate([*base, "--choice", "yes", "--choice", "no"]) == 0
    assert main_generate([*base, "--regex", "[a-z]+"]) == 0
    assert main_generate([*base, "--json-object"]) == 0
    first, choice, regex, obj = (r.sampling for r in servicer.requests)
    assert json.loads(first.guided_json) == json.loads(schema.read_text())
    assert (first.min_tokens, first.min_p) == (2, pytest.approx(0.1))
    assert first.presence_penalty == pytest.approx(0.5)
    assert first.frequency_penalty == pytest.approx(-1.0)
    assert first.repetition_penalty == pytest.approx(1.2)
    assert list(choice.guided_choice) == ["yes", "no"] and not choice.guided_json
    assert regex.guided_regex == "[a-z]+" and obj.guided_json_object
    capsys.readouterr()
    # a schema that is not JSON is refused before anything is sent, naming the flag
    assert main_generate([*base, "--json-schema", "{not json"]) == 2
    assert "--json-schema: is not JSON" in capsys.readouterr().err
    assert main_generate([*base, "--grammar", f"@{tmp_path / 'missing.ebnf'}"]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert len(servicer.requests) == 4
    with pytest.raises(SystemExit):  # one kind of structured output at most
        main_generate([*base, "--regex", "a", "--choice", "b"])
