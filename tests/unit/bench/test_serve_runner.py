"""`bench serve` runner: open loop, outcomes of every kind, conversations' histories."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from pdserve_bench.serve.features import PLAIN
from pdserve_bench.serve.mixes import MULTI_TURN, SHORT_ONLY
from pdserve_bench.serve.records import RequestRecord, Status
from pdserve_bench.serve.runner import run_point
from pdserve_bench.serve.targets import Chunk, TargetError
from pdserve_bench.serve.workload import Load

from .fakes import FakeTarget


class HeldTarget:
    """Answers nothing until ``release`` is set; then what ``behaviour`` says per request."""

    label = "held"
    features = PLAIN

    def __init__(self, behaviour: str = "ok", hold_until: int | None = None) -> None:
        self.behaviour = behaviour
        self.hold_until = hold_until
        self.arrived = 0
        self.release = asyncio.Event()

    async def open(self) -> None: ...

    async def begin_point(self, rate: float | None) -> None: ...

    async def stream(self, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[Chunk]:
        self.arrived += 1
        if self.hold_until is not None and self.arrived == self.hold_until:
            self.release.set()
        await self.release.wait()
        if self.behaviour == "refuse":
            raise TargetError("UNAVAILABLE: no router", admitted=False)
        yield Chunk((1,), 1)
        if self.behaviour == "fail-after-first":
            raise TargetError("INTERNAL: worker died", admitted=False)
        if self.behaviour == "short":
            return
        yield Chunk(tuple([1] * (max_tokens - 1)), max_tokens - 1)

    def describe(self) -> dict[str, Any]:
        return {"kind": "held"}

    async def close(self) -> None: ...


def _run(target: Any, load: Load, rate: float | None, timeout: float = 30.0) -> list[RequestRecord]:
    async def point() -> list[RequestRecord]:
        await target.begin_point(rate)
        return await run_point(target, load.plan(rate), request_timeout_s=timeout)

    return asyncio.run(asyncio.wait_for(point(), 60.0))


def test_open_loop_sends_while_earlier_requests_are_in_flight() -> None:
    """No request is answered before the last has been sent: a closed-loop client would never
    send the last one (and this would time out)."""
    load = Load(1000, mix=SHORT_ONLY, num_requests=12, burst=4)
    target = HeldTarget(hold_until=12)
    records = _run(target, load, 400.0)
    assert all(r.status is Status.OK for r in records)
    last_send = max(r.send_s or 0.0 for r in records)
    assert all(r.chunk_s[0] >= last_send for r in records)
    for r in records:
        assert r.send_s is not None and r.send_s >= r.scheduled_s
        assert r.output_tokens == r.max_tokens and r.admitted and r.error == ""


@pytest.mark.parametrize(
    ("behaviour", "status", "admitted", "error"),
    [
        ("refuse", Status.ERROR, False, "UNAVAILABLE"),
        ("fail-after-first", Status.ERROR, True, "worker died"),  # a token came: admitted
        ("short", Status.ERROR, True, "got 1 of"),
    ],
)
def test_outcomes(behaviour: str, status: Status, admitted: bool, error: str) -> None:
    load = Load(1000, mix=SHORT_ONLY, num_requests=3, burst=0)
    target = HeldTarget(behaviour, hold_until=1)
    for r in _run(target, load, None):
        assert (r.status, r.admitted) == (status, admitted)
        assert error in r.error and r.end_s is not None


def test_rejections_and_timeouts() -> None:
    load = Load(1000, mix=SHORT_ONLY, num_requests=10, burst=0)
    records = _run(FakeTarget("f", lambda _r: 0.5), load, None)
    assert sum(r.status is Status.REJECTED for r in records) == 5
    assert all(not r.admitted and "RESOURCE_EXHAUSTED" in r.error
               for r in records if r.status is Status.REJECTED)  # fmt: skip
    never = HeldTarget()  # never released: every request runs into the timeout
    records = _run(never, Load(1000, mix=SHORT_ONLY, num_requests=2, burst=0), None, 0.05)
    assert all(r.status is Status.ERROR and r.admitted and "timed out" in r.error for r in records)


def test_conversation_turns_carry_the_history_the_target_answered() -> None:
    load = Load(1000, mix=MULTI_TURN, num_requests=60, seed=3)
    plan = load.plan(500.0)
    target = FakeTarget("echo")
    records = _run(target, load, 500.0)
    assert all(r.status is Status.OK for r in records)
    sent = {r.index: p for r, p in zip(records, _in_send_order(records, target), strict=True)}
    last: dict[int, tuple[list[int], RequestRecord]] = {}
    for req, rec in zip(plan.requests, records, strict=True):
        assert req.session is not None
        prompt = sent[rec.index]
        if req.turn == 1:
            assert prompt == list(req.prompt)
        else:
            before, prev = last[req.session]
            answer = [len(before) % 1000] * prev.max_tokens  # the fake's answer to `before`
            assert prompt == before + answer + list(req.prompt)
            assert rec.send_s is not None and prev.end_s is not None
            assert rec.send_s >= prev.end_s  # sent only once the previous turn ended
        assert rec.prompt_tokens == len(prompt)
        last[req.session] = (prompt, rec)
    assert max(r.turn for r in plan.requests) >= 3


def _in_send_order(records: list[RequestRecord], target: FakeTarget) -> list[list[int]]:
    """The fake saw prompts in send order; map them back to records by send time."""
    order = sorted(range(len(records)), key=lambda i: records[i].send_s or 0.0)
    by_record: list[list[int]] = [[] for _ in records]
    for i, prompt in zip(order, target.prompts, strict=True):
        by_record[i] = prompt
    return by_record
