"""SLOs scaled to the machine: each target measured alone, the SLO K x the slowest one's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve_bench.serve import calibrate
from pdserve_bench.serve.calibrate import measure, other_scales, scaled
from pdserve_bench.serve.cli import parser
from pdserve_bench.serve.metrics import Slo
from pdserve_bench.serve.mixes import CHAT, LONG_PROMPT_HEAVY, SHORT_ONLY
from pdserve_bench.serve.settings import settings
from pdserve_bench.serve.sweep import run_all
from pdserve_bench.serve.targets import Chunk
from pdserve_bench.serve.timescale import TimeScale
from pdserve_bench.serve.workload import Load

from .fakes import FakeTarget


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class Timed:
    """First token after ``per_prompt_token_s`` per prompt token, then one ``chunk`` of tokens
    every ``chunk * itl_s``; the clock moves only as it streams."""

    def __init__(self, label: str, clock: Clock, per_prompt_token_s: float, itl_s: float,
                 chunk: int = 1) -> None:  # fmt: skip
        self.label, self.clock = label, clock
        self.per_token, self.itl, self.chunk = per_prompt_token_s, itl_s, chunk
        self.prompts: list[int] = []

    async def stream(self, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[Chunk]:
        self.prompts.append(len(prompt))
        self.clock.now += len(prompt) * self.per_token
        yield Chunk(None, 1)
        left = max_tokens - 1
        while left > 0:
            n = min(self.chunk, left)
            self.clock.now += n * self.itl
            left -= n
            yield Chunk(None, n)

    def describe(self) -> dict[str, Any]:
        return {}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(calibrate.time, "perf_counter", c)
    return c


def test_the_slo_is_k_times_the_slowest_target_alone(clock: Clock) -> None:
    fast_prefill = Timed("a", clock, 0.001, 0.010)
    slow_prefill = Timed("b", clock, 0.002, 0.005, chunk=4)  # its gaps come 4 tokens at a time
    found = [
        asyncio.run(measure(t, LONG_PROMPT_HEAVY, 1000))  # type: ignore[arg-type]
        for t in (fast_prefill, slow_prefill)
    ]
    # The longest class's longest prompt for TTFT, the shortest one's shortest for ITL.
    assert fast_prefill.prompts == [2400] * calibrate.REPS + [35] * calibrate.REPS
    assert [f.ttft_s for f in found] == pytest.approx([2.4, 4.8])
    assert [f.itl_s for f in found] == pytest.approx([0.010, 0.005])
    three = scaled(3, found)
    assert (three.slo.ttft_s, three.slo.itl_s) == pytest.approx((14.4, 0.030))
    text = three.describe()
    assert (
        "b's isolated 4.8 s for 2400 prompt tokens" in text and "a's isolated ITL p50 10 ms" in text
    )
    assert three.to_json()["isolated"][1]["label"] == "b"


def test_modelled_time_divides_by_the_time_scale(clock: Clock) -> None:
    t = Timed("sim", clock, 0.001, 0.010)
    found = asyncio.run(measure(t, CHAT, 1000, scale=TimeScale(10.0)))  # type: ignore[arg-type]
    assert (found.ttft_s, found.itl_s) == pytest.approx((0.08, 0.001))


def test_other_scales_judge_the_same_records_again() -> None:
    load = Load(1000, mix=SHORT_ONLY, num_requests=6)
    target = FakeTarget("f")
    result = asyncio.run(run_all([target], load, rates=[10.0], search=None, slo=Slo(),
                                 request_timeout_s=30.0))  # fmt: skip
    iso = [calibrate.Isolated("f", 1e-9, 1e-9, 110, 35)]
    lines = other_scales(result, [scaled(1.0, iso)])  # nothing is that fast: goodput 0
    assert lines[1] == "  f at 10 req/s: goodput 0.00"


def test_slo_scale_needs_a_mix_and_a_positive_k(tmp_path: Any) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 4}\n')
    args = parser().parse_args(["--router", "x:1", "--trace", str(trace), "--slo-scale", "3",
                                "--vocab-size", "100"])  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="--slo-scale: needs a mix"):
        settings(args)
    with pytest.raises(InvalidArgumentError, match="must be > 0"):
        scaled(0, [calibrate.Isolated("f", 1.0, 1.0, 1, 1)])
