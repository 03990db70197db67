"""AsyncEngine under injected engine faults (a real engine, real model): a failed request
fails alone with INTERNAL while the streams beside it complete token for token; a run of
failed steps ends the engine, which says so (snapshot, ``failed()``) and refuses new work."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.faults import EngineFaults
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine_loop.async_engine import AsyncEngine
from pdserve.engine_loop.state import FailureTracker
from pdserve.errors import InvalidArgumentError, RequestFailedError, WorkerUnavailableError
from pdserve.worker.fault_specs import parse_engine_faults, parse_faults
from tests.unit.engine_loop.test_async_engine import collect, prompts, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, seed=9, max_tokens=16, ignore_eos=True)


def load(model_dir: Path, faults: EngineFaults | None = None) -> Engine:
    return Engine.from_pretrained(model_dir, dtype="float32", num_kv_blocks=128, faults=faults)


async def tokens_of(ae: AsyncEngine, rid: str, prompt: list[int], p: SamplingParams) -> list[int]:
    return [t for out in await collect(ae, rid, prompt, p) for t in out.new_token_ids]


def test_a_poisoned_request_fails_alone_among_streams_in_flight(tiny_llama_dir: Path) -> None:
    ps = prompts(11, [6, 25, 14, 33, 9])
    params = [GREEDY, SAMPLED, GREEDY, SAMPLED]
    reference = AsyncEngine(load(tiny_llama_dir))
    ae = AsyncEngine(load(tiny_llama_dir, EngineFaults(nan_prefix="bad")))

    async def body() -> None:
        reference.start()
        try:
            undisturbed = await asyncio.gather(
                *(tokens_of(reference, f"r{i}", ps[i], p) for i, p in enumerate(params))
            )
        finally:
            await reference.close()
        ae.start()
        try:
            results = await asyncio.gather(
                *(tokens_of(ae, f"r{i}", ps[i], p) for i, p in enumerate(params)),
                tokens_of(ae, "bad", ps[4], GREEDY),
                return_exceptions=True,
            )
            assert isinstance(results[-1], RequestFailedError)
            assert results[-1].grpc_code == "INTERNAL"
            assert results[:-1] == undisturbed
            assert all(len(t) == 16 for t in undisturbed)
            snap = ae.snapshot()
            assert (snap.failed_requests, snap.failed) == (1, False)
            assert snap.failed_steps >= 1
            # Still serving.
            assert await tokens_of(ae, "again", ps[0], GREEDY) == undisturbed[0]
        finally:
            await ae.close()

    run(body)
    ae.engine.check_no_leaks()


def test_consecutive_failed_steps_end_the_engine_and_it_says_so(tiny_llama_dir: Path) -> None:
    ae = AsyncEngine(load(tiny_llama_dir, EngineFaults(step_prefix="boom")))
    ps = prompts(12, [8, 8])
    short = dataclasses.replace(GREEDY, max_tokens=4)

    async def body() -> None:
        ae.start()
        watcher = asyncio.ensure_future(ae.failed())
        try:
            # Failures with progress in between never add up.
            for i in range(4):
                with pytest.raises(RequestFailedError, match="injected fault"):
                    await tokens_of(ae, f"boom-{i}", ps[0], short)
                assert len(await tokens_of(ae, f"ok-{i}", ps[1], short)) == 4
            assert not watcher.done() and not ae.snapshot().failed
            for i in range(2):  # two in a row: still alive (the limit is three)
                with pytest.raises(RequestFailedError):
                    await tokens_of(ae, f"boom-x{i}", ps[0], short)
            assert not ae.snapshot().failed
            with pytest.raises(RequestFailedError):  # the third: the engine gives up
                await tokens_of(ae, "boom-last", ps[0], short)
            err = await asyncio.wait_for(watcher, 30)
            assert "failed in an engine step" in str(err)
            assert await ae.failed() is err  # after the fact, at once
            snap = ae.snapshot()
            assert snap.failed and snap.tags == () and snap.failed_requests == 7
            with pytest.raises(WorkerUnavailableError, match="engine failed"):
                await tokens_of(ae, "late", ps[1], short)
        finally:
            watcher.cancel()
            await ae.close()

    run(body)


def test_failure_tracker_counts() -> None:
    t = FailureTracker(2)
    assert not t.step_failed(1, progressed=True)
    assert not t.step_failed(2, progressed=False)
    t.step_succeeded()
    assert not t.step_failed(1, progressed=False)
    assert t.step_failed(1, progressed=False)
    assert (t.failed_steps, t.failed_requests, t.consecutive) == (4, 5, 2)


def test_fault_flags_split_into_engine_and_hand_off_faults() -> None:
    specs = ["nan@bad-", "stall:2@slow-", "step"]
    assert parse_engine_faults(specs) == EngineFaults(nan_prefix="bad-", step_prefix="")
    send = parse_faults(specs)
    assert send is not None and send.stall_prefix == "slow-" and send.corrupt_prefix is None
    assert parse_engine_faults(["corrupt"]) is None
    with pytest.raises(InvalidArgumentError, match="--fault"):
        parse_engine_faults(["nan:3"])
