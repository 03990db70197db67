"""RequestFlow while the scheduler cannot place a request: it waits for a scheduler that comes
back (UNAVAILABLE), and a placement after a failover waits for room (RESOURCE_EXHAUSTED), both
bounded by ``WaitPolicy.bound_s`` and the deadline, cancellable, and recorded (scripted
in-process services of ``router/test_flow``)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.errors import InvalidArgumentError
from pdserve.router import FlowConfig, RequestFlow
from pdserve.router.downstream import DownstreamError
from pdserve.router.scheduler_wait import WaitPolicy
from pdserve.router.telemetry import RouterTelemetry
from pdserve.telemetry.metrics import RouterMetrics
from pdserve.telemetry.spans import ATTR_WAIT_CAUSE, ATTR_WAIT_OUTCOME, ROUTER_SCHEDULER_WAIT
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import scheduler_pb2
from tests.unit.router.test_flow import DECODED, FIRST, Fakes, _collect, _request, run_with_fakes

QUICK = WaitPolicy(bound_s=30.0, initial_backoff_s=0.01, max_backoff_s=0.02)
"""Short sleeps, a bound no test reaches unless it means to."""

Refusal = Callable[[scheduler_pb2.AssignRequest], grpc.StatusCode | None]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


class Refusing:
    """Configures the fakes' Assign to fail with ``refusal(request)`` when that is a code."""

    def __init__(self, refusal: Refusal) -> None:
        self.refusal = refusal
        self.refused = 0

    def __call__(self, f: Fakes) -> None:
        assign = f.Assign

        async def refused_assign(request: Any, context: Any) -> scheduler_pb2.Assignment:
            code = self.refusal(request)
            if code is not None:
                self.refused += 1
                await context.abort(code, "scheduler restarting or full")
            return await assign(request, context)

        f.Assign = refused_assign  # type: ignore[method-assign]


def first(n: int, code: grpc.StatusCode, *, replacing: bool = False) -> Refusal:
    """Fail the first ``n`` Assign calls (of re-placements only, with ``replacing``)."""
    left = [n]

    def refusal(request: scheduler_pb2.AssignRequest) -> grpc.StatusCode | None:
        if replacing and not request.exclude:
            return None
        if left[0] > 0:
            left[0] -= 1
            return code
        return None

    return refusal


def observed_run(
    tokenizer: Tokenizer, configure: Callable[[Fakes], None], config: FlowConfig
) -> tuple[Fakes, list[int], RouterMetrics, InMemorySpanExporter]:
    """One request through the flow under the router's telemetry: the fakes, its tokens,
    the metrics and the finished spans."""
    metrics = RouterMetrics(process=False)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = RouterTelemetry(metrics, tracer_provider=provider)
    tokens: list[int] = []

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        with telemetry.request("t") as observed:
            chunks = await _collect(flow, _request(tokenizer), timeout_s=30, observed=observed)
        tokens.extend(t for c in chunks for t in c.token_ids)

    fakes = run_with_fakes(tokenizer, configure, body, config)
    return fakes, tokens, metrics, exporter


def wait_events(exporter: InMemorySpanExporter) -> list[dict[str, Any]]:
    return [
        dict(event.attributes or {})
        for span in exporter.get_finished_spans()
        for event in span.events
        if event.name == ROUTER_SCHEDULER_WAIT
    ]


def waiting(metrics: RouterMetrics) -> float | None:
    return metrics.registry.get_sample_value("pdserve_router_scheduler_waiting")


def waits(metrics: RouterMetrics, cause: str) -> float | None:
    return metrics.registry.get_sample_value(
        "pdserve_router_scheduler_wait_seconds_count", {"cause": cause}
    )


def test_a_request_waits_for_the_scheduler_to_come_back(tokenizer: Tokenizer) -> None:
    refusing = Refusing(first(4, grpc.StatusCode.UNAVAILABLE))
    fakes, tokens, metrics, exporter = observed_run(
        tokenizer, refusing, FlowConfig(scheduler_wait=QUICK)
    )
    assert tokens == [FIRST, *DECODED]
    assert refusing.refused == 4 and fakes.assigned == ["res-0"]
    (event,) = wait_events(exporter)
    assert event[ATTR_WAIT_CAUSE] == "unavailable" and event[ATTR_WAIT_OUTCOME] == "ok"
    assert waits(metrics, "unavailable") == 1 and waiting(metrics) == 0


def test_the_wait_is_bounded(tokenizer: Tokenizer) -> None:
    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        with pytest.raises(DownstreamError) as info:
            await _collect(flow, _request(tokenizer), timeout_s=30)
        assert info.value.grpc_code == "UNAVAILABLE"
        assert "after waiting" in str(info.value) and "--scheduler-wait-s" in str(info.value)

    bound = WaitPolicy(bound_s=0.2, initial_backoff_s=0.01, max_backoff_s=0.02)
    refusing = Refusing(lambda _: grpc.StatusCode.UNAVAILABLE)
    fakes = run_with_fakes(tokenizer, refusing, body, FlowConfig(scheduler_wait=bound))
    assert refusing.refused > 1 and not fakes.assigned


def test_no_wait_with_a_zero_bound(tokenizer: Tokenizer) -> None:
    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        with pytest.raises(DownstreamError) as info:
            await _collect(flow, _request(tokenizer), timeout_s=30)
        assert info.value.grpc_code == "UNAVAILABLE" and "waiting" not in str(info.value)

    refusing = Refusing(lambda _: grpc.StatusCode.UNAVAILABLE)
    run_with_fakes(tokenizer, refusing, body, FlowConfig(scheduler_wait=WaitPolicy(bound_s=0)))
    assert refusing.refused == 1


def test_a_first_placement_is_refused_at_once_when_full(tokenizer: Tokenizer) -> None:
    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        with pytest.raises(DownstreamError) as info:
            await _collect(flow, _request(tokenizer), timeout_s=30)
        assert info.value.grpc_code == "RESOURCE_EXHAUSTED"

    refusing = Refusing(lambda _: grpc.StatusCode.RESOURCE_EXHAUSTED)
    run_with_fakes(tokenizer, refusing, body, FlowConfig(scheduler_wait=QUICK))
    assert refusing.refused == 1


def test_a_placement_after_a_failover_waits_for_room(tokenizer: Tokenizer) -> None:
    refusing = Refusing(first(3, grpc.StatusCode.RESOURCE_EXHAUSTED, replacing=True))

    def configure(f: Fakes) -> None:
        refusing(f)
        f.prefill_failures = 1  # the worker dies: the request is placed again, full at first

    fakes, tokens, metrics, exporter = observed_run(
        tokenizer, configure, FlowConfig(scheduler_wait=QUICK)
    )
    assert tokens == [FIRST, *DECODED]
    assert refusing.refused == 3
    assert [list(r.exclude) for r in fakes.assign_requests] == [[], ["w0"]]
    (event,) = wait_events(exporter)
    assert event[ATTR_WAIT_CAUSE] == "full" and event[ATTR_WAIT_OUTCOME] == "ok"
    assert waits(metrics, "full") == 1 and waiting(metrics) == 0


def test_a_waiting_request_is_cancelled_by_its_caller(tokenizer: Tokenizer) -> None:
    metrics = RouterMetrics(process=False)
    telemetry = RouterTelemetry(metrics)

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        async def call() -> None:
            with telemetry.request("t") as observed:
                await _collect(flow, _request(tokenizer), timeout_s=30, observed=observed)

        task = asyncio.create_task(call())
        while waiting(metrics) != 1 or refusing.refused < 3:
            await asyncio.sleep(0.01)  # polling the flow's progress
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    refusing = Refusing(lambda _: grpc.StatusCode.UNAVAILABLE)
    fakes = run_with_fakes(tokenizer, refusing, body, FlowConfig(scheduler_wait=QUICK))
    assert not fakes.assigned and not fakes.released
    assert waiting(metrics) == 0 and waits(metrics, "unavailable") == 1
    requests = metrics.registry.get_sample_value
    assert requests("pdserve_requests_total", {"outcome": "cancelled"}) == 1


def test_a_dead_replica_is_skipped_without_waiting(tokenizer: Tokenizer) -> None:
    with socket.socket() as s:  # a port nobody listens on: a replica that died
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    metrics = RouterMetrics(process=False)
    telemetry = RouterTelemetry(metrics)

    async def body(_: RequestFlow, fakes: Fakes) -> None:
        flow = RequestFlow(
            scheduler_address=[dead, fakes.address],
            tokenizer=tokenizer,
            config=FlowConfig(scheduler_wait=QUICK),
        )
        try:
            for _ in range(4):  # each replica comes first in turn
                with telemetry.request("t") as observed:
                    chunks = await _collect(flow, _request(tokenizer), observed=observed)
                assert [t for c in chunks for t in c.token_ids] == [FIRST, *DECODED]
        finally:
            await flow.close()

    fakes = run_with_fakes(tokenizer, lambda _: None, body)
    assert len(fakes.assigned) == 4
    assert waits(metrics, "unavailable") is None  # never waited


def test_the_policy_is_checked() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        WaitPolicy(bound_s=-1)
    assert info.value.field == "scheduler_wait_s"
    with pytest.raises(InvalidArgumentError):
        WaitPolicy(initial_backoff_s=2, max_backoff_s=1)
    policy = WaitPolicy(initial_backoff_s=0.1, max_backoff_s=0.4)
    for rounds, step in ((1, 0.1), (2, 0.2), (3, 0.4), (9, 0.4)):
        assert step / 2 <= policy.backoff_s(rounds) <= step


def test_a_long_wait_keeps_its_capped_backoff() -> None:
    # A 30 s wait at a 20 ms cap runs past a thousand rounds; 2.0 ** 1024 overflows a float,
    # which once ended such a wait in an OverflowError instead of the next round.
    policy = WaitPolicy(bound_s=30.0, initial_backoff_s=0.01, max_backoff_s=0.02)
    for rounds in (1024, 1025, 5000, 10**9):
        assert 0.01 <= policy.backoff_s(rounds) <= 0.02
    flat = WaitPolicy(initial_backoff_s=0.1, max_backoff_s=0.1, multiplier=1.0)
    assert 0.05 <= flat.backoff_s(10**9) <= 0.1
