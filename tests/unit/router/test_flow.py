"""RequestFlow against scripted in-process Scheduler, Prefill, Decode and KVStore services.

Checks the order of calls and, above all, the clean-up on every way out: the reservation is
released, downstream calls are cancelled, and a KV payload no decode worker took is deleted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.engine.outputs import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import DuplicateRequestError, HandedBackError, PdServeError
from pdserve.request_key import RequestKey
from pdserve.router import FlowConfig, RequestFlow, RouteChunk, RouteRequest
from pdserve.router.downstream import DeadlineExceededError, DownstreamError
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

FIRST = 7
DECODED = [8, 9, 10]
KV_KEY = f"kv-{RequestKey('', 'r1').scoped_id}"
"""The fake prefill's KV key of ``_request``: made of the id the worker got."""


@dataclass
class Fakes(
    scheduler_pb2_grpc.SchedulerServicer,
    prefill_pb2_grpc.PrefillServicer,
    decode_pb2_grpc.DecodeServicer,
    kvstore_pb2_grpc.KVStoreServicer,
):
    """All four downstream services in one object; ``address`` is where they listen."""

    address: str = ""
    assign_error: grpc.StatusCode | None = None
    assign_gate: asyncio.Event | None = None
    prefill_finish: int = common_pb2.FINISH_REASON_UNSPECIFIED
    decode_error: grpc.StatusCode | None = None
    decode_hang: bool = False
    decode_tokens: list[int] = field(default_factory=lambda: list(DECODED))
    decode_timing: common_pb2.Timing = field(
        default_factory=lambda: common_pb2.Timing(queue_ms=4.0, transfer_ms=5.0, decode_ms=6.0)
    )
    release_gate: asyncio.Event | None = None
    release_seen: asyncio.Event = field(default_factory=asyncio.Event)
    assigned: list[str] = field(default_factory=list)
    released: list[tuple[str, bool]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    prefill_time_left: list[float | None] = field(default_factory=list)
    decode_calls: int = 0
    decode_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    release_failures: int = 0
    """The first this many full Release calls fail with UNAVAILABLE (a scheduler restarting)."""
    prefill_failures: int = 0
    """The first this many Prefill calls fail with UNAVAILABLE (a worker that died)."""
    prefill_refusal: tuple[grpc.StatusCode, str] | None = None
    """Every Prefill call fails with this status and details (a worker refusing the request)."""
    decode_dies_after: int | None = None
    """The first Decode call streams this many tokens, then fails with UNAVAILABLE."""
    decode_handbacks: int = 0
    """The first this many Decode calls stream one token, then hand the request back (a
    worker leaving decode duty: ``HandedBackError``)."""
    assign_requests: list[scheduler_pb2.AssignRequest] = field(default_factory=list)
    decode_requests: list[decode_pb2.DecodeRequest] = field(default_factory=list)

    async def Assign(self, request: Any, context: Any) -> scheduler_pb2.Assignment:  # noqa: N802
        if self.assign_gate is not None:
            await self.assign_gate.wait()
        if self.assign_error is not None:
            await context.abort(self.assign_error, "no room")
        self.assign_requests.append(request)
        rid = f"res-{len(self.assigned)}"
        self.assigned.append(rid)
        # A new worker id per placement (all served here), so exclusions can be checked.
        worker = scheduler_pb2.WorkerRef(id=f"w{rid[4:]}", address=self.address, host="h")
        return scheduler_pb2.Assignment(
            reservation_id=rid, prefill=worker, decode=worker,
            mode=common_pb2.MODE_DISAGGREGATED, ttl_s=60.0,
        )  # fmt: skip

    async def Release(self, request: Any, context: Any) -> scheduler_pb2.ReleaseResponse:  # noqa: N802
        if not request.prefill_only:
            self.release_seen.set()
        if self.release_gate is not None and not request.prefill_only:
            await self.release_gate.wait()
        if self.release_failures > 0 and not request.prefill_only:
            self.release_failures -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler restarting")
        self.released.append((request.reservation_id, request.prefill_only))
        return scheduler_pb2.ReleaseResponse(released=True)

    async def Prefill(self, request: Any, context: Any) -> prefill_pb2.PrefillResponse:  # noqa: N802
        self.prefill_time_left.append(context.time_remaining())
        if self.prefill_failures > 0:
            self.prefill_failures -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker went away")
        if self.prefill_refusal is not None:
            await context.abort(*self.prefill_refusal)
        resp = prefill_pb2.PrefillResponse(
            first_token_id=FIRST, first_logprob=-1.0, finish_reason=self.prefill_finish,  # type: ignore[arg-type]
            queue_ms=1.0, compute_ms=2.0, transfer_ms=3.0, transfer_bytes=100,
        )  # fmt: skip
        if self.prefill_finish == common_pb2.FINISH_REASON_UNSPECIFIED:
            resp.kv.CopyFrom(
                common_pb2.KVHandle(
                    request_id=request.request_id,
                    num_tokens=len(request.prompt_token_ids),
                    store=common_pb2.StoreLocation(
                        address=self.address, key=f"kv-{request.request_id}"
                    ),
                )
            )
        return resp

    async def Decode(self, request: Any, context: Any) -> AsyncIterator[decode_pb2.DecodeChunk]:  # noqa: N802
        self.decode_calls += 1
        self.decode_requests.append(request)
        if self.decode_error is not None:
            await context.abort(self.decode_error, "worker went away")
        dies_after, self.decode_dies_after = self.decode_dies_after, None
        hands_back = self.decode_handbacks > 0
        self.decode_handbacks -= hands_back
        # A migrated call continues after the tokens it is given.
        tokens = self.decode_tokens[len(request.resumed_token_ids) :]
        try:
            for i, token in enumerate(tokens):
                if i == dies_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker died")
                if hands_back and i == 1:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(HandedBackError("duty")))
                last = i == len(tokens) - 1 and not self.decode_hang
                chunk = decode_pb2.DecodeChunk(token_ids=[token], logprobs=[-0.5])
                if last:
                    chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
                    chunk.timing.CopyFrom(self.decode_timing)
                yield chunk
            if self.decode_hang:
                await asyncio.Event().wait()  # until cancelled
        except asyncio.CancelledError:
            self.decode_cancelled.set()
            raise

    async def Delete(self, request: Any, context: Any) -> kvstore_pb2.DeleteResponse:  # noqa: N802
        self.deleted.append(request.key)
        return kvstore_pb2.DeleteResponse(deleted=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def run_with_fakes(
    tokenizer: Tokenizer,
    configure: Callable[[Fakes], None],
    body: Callable[[RequestFlow, Fakes], Awaitable[Any]],
    config: FlowConfig | None = None,
) -> Fakes:
    """Serve the fakes, run ``body`` with a flow pointed at them, wait for its clean-ups."""

    async def main() -> Fakes:
        fakes = Fakes()
        configure(fakes)
        server = grpc.aio.server()
        for add in (
            scheduler_pb2_grpc.add_SchedulerServicer_to_server,
            prefill_pb2_grpc.add_PrefillServicer_to_server,
            decode_pb2_grpc.add_DecodeServicer_to_server,
            kvstore_pb2_grpc.add_KVStoreServicer_to_server,
        ):
            add(fakes, server)  # type: ignore[operator]
        fakes.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        flow = RequestFlow(scheduler_address=fakes.address, tokenizer=tokenizer, config=config)
        try:
            await body(flow, fakes)
        finally:
            await flow.close()  # waits for every clean-up
            await server.stop(None)
        return fakes

    return asyncio.run(main())


def _request(tokenizer: Tokenizer, *, stop: tuple[str, ...] = ()) -> RouteRequest:
    return RouteRequest(
        "r1", tuple(tokenizer.encode("hello")), SamplingParams(max_tokens=4, stop=stop)
    )


async def _collect(flow: RequestFlow, req: RouteRequest, **kw: Any) -> list[RouteChunk]:
    return [c async for c in flow.generate(req, **kw)]


def test_happy_path_streams_first_token_alone_then_decode(tokenizer: Tokenizer) -> None:
    got: list[RouteChunk] = []

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        got.extend(await _collect(flow, _request(tokenizer), timeout_s=30))

    fakes = run_with_fakes(tokenizer, lambda f: None, body)
    assert [c.token_ids for c in got] == [[FIRST], *([t] for t in DECODED)]
    assert [c.finish_reason for c in got] == [None, None, None, FinishReason.LENGTH]
    assert "".join(c.text for c in got) == tokenizer.decode([FIRST, *DECODED])
    last = got[-1]
    assert last.usage is not None and last.usage.completion_tokens == 4
    assert last.usage.prompt_tokens == len(tokenizer.encode("hello"))
    assert last.timing is not None
    assert (last.timing.prefill_ms, last.timing.transfer_ms, last.timing.decode_ms) == (
        2.0,
        8.0,
        6.0,
    )
    assert last.timing.transport == "store" and last.timing.transfer_bytes == 100
    assert sorted(fakes.released) == [("res-0", False), ("res-0", True)]
    assert fakes.deleted == []  # the decode worker took the payload
    (left,) = fakes.prefill_time_left
    assert left is not None and 0 < left <= 30  # the caller's deadline went downstream


def test_a_decode_side_recompute_counts_as_prefill_time(tokenizer: Tokenizer) -> None:
    got: list[RouteChunk] = []

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        got.extend(await _collect(flow, _request(tokenizer)))

    def configure(f: Fakes) -> None:
        # The decode worker's receive failed after 0.5 ms; it prefilled for 7 ms instead.
        f.decode_timing = common_pb2.Timing(
            queue_ms=4.0, prefill_ms=7.0, transfer_ms=0.5, decode_ms=6.0,
            transfer_bytes=0, transport="recompute",
        )  # fmt: skip

    run_with_fakes(tokenizer, configure, body)
    timing = got[-1].timing
    assert timing is not None
    # Prefill worker (compute 2, sent in 3) + the decode worker's own figures.
    assert timing.prefill_ms == 2.0 + 7.0
    assert timing.transfer_ms == 3.0 + 0.5
    assert timing.queue_ms >= 1.0 + 4.0  # plus the placement, timed by the router
    assert timing.decode_ms == 6.0
    assert timing.transport == "recompute" and timing.transfer_bytes == 0


def test_the_call_ends_without_waiting_for_the_release(tokenizer: Tokenizer) -> None:
    got: list[RouteChunk] = []

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        async def consume() -> None:
            got.extend([c async for c in flow.generate(_request(tokenizer))])

        # The whole stream, its clean-up included, ends while the scheduler holds the release
        # at its gate (were the stream to wait for it, this would time out).
        await asyncio.wait_for(consume(), 10)
        await asyncio.wait_for(fakes.release_seen.wait(), 10)  # the release is on its way
        assert ("res-0", False) not in fakes.released  # held at the gate
        assert fakes.release_gate is not None
        fakes.release_gate.set()  # flow.close() waits for it (run_with_fakes)

    def configure(f: Fakes) -> None:
        f.release_gate = asyncio.Event()

    fakes = run_with_fakes(tokenizer, configure, body)
    assert got[-1].finish_reason is FinishReason.LENGTH
    assert sorted(fakes.released) == [("res-0", False), ("res-0", True)]


def test_first_token_that_finishes_skips_decode(tokenizer: Tokenizer) -> None:
    got: list[RouteChunk] = []

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        got.extend(await _collect(flow, _request(tokenizer)))

    def configure(f: Fakes) -> None:
        f.prefill_finish = common_pb2.FINISH_REASON_STOP

    fakes = run_with_fakes(tokenizer, configure, body)
    assert (
        len(got) == 1 and got[0].token_ids == [FIRST] and got[0].finish_reason is FinishReason.STOP
    )
    assert fakes.decode_calls == 0 and fakes.released == [("res-0", False)]


def test_assign_refusal_passes_through(tokenizer: Tokenizer) -> None:
    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        with pytest.raises(DownstreamError) as info:
            await _collect(flow, _request(tokenizer))
        assert info.value.grpc_code == "RESOURCE_EXHAUSTED" and "no room" in str(info.value)

    def configure(f: Fakes) -> None:
        f.assign_error = grpc.StatusCode.RESOURCE_EXHAUSTED

    fakes = run_with_fakes(tokenizer, configure, body)
    assert fakes.released == []


def test_decode_failure_is_reported_and_cleaned_up(tokenizer: Tokenizer) -> None:
    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        with pytest.raises(DownstreamError) as info:
            await _collect(flow, _request(tokenizer))
        assert info.value.grpc_code == "UNAVAILABLE"
        assert "Decode on w0" in str(info.value) and "worker went away" in str(info.value)

    def configure(f: Fakes) -> None:
        f.decode_error = grpc.StatusCode.UNAVAILABLE

    fakes = run_with_fakes(tokenizer, configure, body, FlowConfig(migration_limit=0))
    assert ("res-0", False) in fakes.released
    assert fakes.deleted == [KV_KEY]  # nobody consumed the payload


def test_leaving_after_the_first_token_deletes_the_payload(tokenizer: Tokenizer) -> None:
    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        stream = flow.generate(_request(tokenizer))
        first = await anext(stream)
        assert first.token_ids == [FIRST]
        await stream.aclose()

    fakes = run_with_fakes(tokenizer, lambda f: None, body)
    assert fakes.decode_calls == 0
    assert fakes.deleted == [KV_KEY]
    assert fakes.released == [("res-0", False)]


def test_cancel_mid_decode_cancels_the_decode_call(tokenizer: Tokenizer) -> None:
    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        async def consume() -> None:
            async for chunk in flow.generate(_request(tokenizer)):
                if chunk.token_ids == [DECODED[-1]]:
                    task.cancel()  # what grpc does to a handler whose client went away

        task = asyncio.ensure_future(consume())
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(fakes.decode_cancelled.wait(), 10)

    def configure(f: Fakes) -> None:
        f.decode_hang = True

    fakes = run_with_fakes(tokenizer, configure, body)
    assert ("res-0", False) in fakes.released
    assert fakes.deleted == []  # the decode worker had it


def test_assign_that_outlives_the_deadline_is_released(tokenizer: Tokenizer) -> None:
    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        with pytest.raises(DeadlineExceededError):
            await _collect(flow, _request(tokenizer), timeout_s=0.05)
        assert fakes.assign_gate is not None
        fakes.assign_gate.set()  # the scheduler commits after the caller gave up

    def configure(f: Fakes) -> None:
        f.assign_gate = asyncio.Event()

    fakes = run_with_fakes(tokenizer, configure, body)
    assert fakes.assigned == ["res-0"] and fakes.released == [("res-0", False)]


def test_a_stop_string_seen_by_the_router_ends_the_stream(tokenizer: Tokenizer) -> None:
    got: list[RouteChunk] = []
    stop = tokenizer.decode([DECODED[0]]).strip()
    if not stop:
        pytest.skip("the decoded token renders as whitespace only")

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        got.extend(await _collect(flow, _request(tokenizer, stop=(stop,))))

    def configure(f: Fakes) -> None:
        f.decode_hang = True  # the worker would go on; the router must stop on its own

    fakes = run_with_fakes(tokenizer, configure, body)
    tokens = [t for c in got for t in c.token_ids]
    assert tokens == [FIRST, DECODED[0]] and got[-1].finish_reason is FinishReason.STOP
    full = tokenizer.decode(tokens)
    assert "".join(c.text for c in got) == full[: full.index(stop)]
    assert ("res-0", False) in fakes.released


def test_errors_are_pdserve_errors() -> None:
    # The rpc error mapping turns these into statuses by their grpc_code.
    assert issubclass(DownstreamError, PdServeError) and issubclass(
        DeadlineExceededError, PdServeError
    )
    assert DeadlineExceededError.grpc_code == "DEADLINE_EXCEEDED"


def test_every_service_gets_the_id_scoped_by_tenant_the_caller_its_own(
    tokenizer: Tokenizer,
) -> None:
    got: list[RouteChunk] = []
    prefill_ids: list[str] = []
    req = RouteRequest("r1", (5, 6, 7), SamplingParams(max_tokens=4), tenant="acme")

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        got.extend(await _collect(flow, req))

    def configure(f: Fakes) -> None:
        prefill = f.Prefill

        async def spy(request: Any, context: Any) -> prefill_pb2.PrefillResponse:
            prefill_ids.append(request.request_id)
            return await prefill(request, context)

        f.Prefill = spy  # type: ignore[method-assign]

    fakes = run_with_fakes(tokenizer, configure, body)
    scoped = RequestKey("acme", "r1").scoped_id
    assert [r.request_id for r in fakes.assign_requests] == [scoped]
    assert prefill_ids == [scoped]
    assert [(r.request_id, r.kv.request_id) for r in fakes.decode_requests] == [(scoped, scoped)]
    assert {c.request_id for c in got} == {"r1"}  # the caller sees its own id


def test_an_id_in_flight_is_refused_to_its_tenant_only(tokenizer: Tokenizer) -> None:
    def request(tenant: str) -> RouteRequest:
        return RouteRequest("x", (5, 6, 7), SamplingParams(max_tokens=4), tenant=tenant)

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        first = flow.generate(request("acme"))
        assert (await anext(first)).token_ids == [FIRST]  # in flight: its decode hangs
        with pytest.raises(DuplicateRequestError, match="'x' is already in flight"):
            await _collect(flow, request("acme"), timeout_s=10)  # bounded: decodes hang
        # The same id of another tenant (the empty one too) is another request.
        fakes.decode_hang = False
        for tenant in ("globex", ""):
            other = await _collect(flow, request(tenant))
            assert other[-1].finish_reason is FinishReason.LENGTH
            assert {c.request_id for c in other} == {"x"}
        await first.aclose()
        # Once its request has ended, the tenant may use the id again.
        done = await _collect(flow, request("acme"))
        assert done[-1].finish_reason is FinishReason.LENGTH
        assert len(flow.in_flight) == 0

    def configure(f: Fakes) -> None:
        f.decode_hang = True

    fakes = run_with_fakes(tokenizer, configure, body)
    # Four placements (the refused request got none), each released in full.
    assert fakes.assigned == ["res-0", "res-1", "res-2", "res-3"]
    assert {r for r, prefill_only in fakes.released if not prefill_only} == set(fakes.assigned)
