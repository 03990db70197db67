"""AsyncEngine: same tokens as the engine alone, cancellation frees blocks, prefill batching,
errors reach the awaiting caller, close aborts everything."""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from pathlib import Path

import pytest
import torch

from pdserve.engine.engine import Engine
from pdserve.engine.kv_tensors import as_tensor
from pdserve.engine.outputs import FinishReason, RequestOutput
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine_loop.async_engine import AsyncEngine
from pdserve.engine_loop.batch_window import BatchWindow
from pdserve.engine_loop.commands import AbortCommand, Command, StopCommand
from pdserve.errors import DuplicateRequestError, InvalidArgumentError, WorkerUnavailableError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(n: int, lengths: list[int], vocab: int = 2048) -> list[list[int]]:
    rng = random.Random(n)
    return [[rng.randrange(vocab) for _ in range(length)] for length in lengths]


def load(model_dir: Path, **config: object) -> Engine:
    return Engine.from_pretrained(model_dir, dtype="float32", num_kv_blocks=128, **config)  # type: ignore[arg-type]


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=120))


async def collect(
    ae: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    outs = []
    async with aclosing(ae.generate(EngineRequest(rid, prompt, params))) as stream:
        async for out in stream:
            outs.append(out)
    return outs


def test_generate_matches_engine_alone(tiny_llama_dir: Path) -> None:
    ps = prompts(0, [5, 23, 40])
    reference = load(tiny_llama_dir).generate(ps, GREEDY)
    ae = AsyncEngine(load(tiny_llama_dir))
    ae.start()

    async def body() -> None:
        try:
            results = await asyncio.gather(
                *(collect(ae, f"r{i}", p, GREEDY) for i, p in enumerate(ps))
            )
        finally:
            await ae.close()
        for outs, ref in zip(results, reference, strict=True):
            assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
            assert [lp for o in outs for lp in o.new_logprobs] == pytest.approx(
                ref.logprobs, abs=1e-4
            )
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
            assert outs[-1].finish_reason is FinishReason.LENGTH

    run(body)
    ae.engine.check_no_leaks()


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_cancel_mid_stream_frees_blocks(tiny_llama_dir: Path, how: str) -> None:
    """``aclose``: the consumer leaves its loop early; ``cancel``: its task is cancelled while
    it waits for the next output (what a cancelled RPC does to a handler)."""
    ae = AsyncEngine(load(tiny_llama_dir))
    ae.start()
    long = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    total = ae.stats().num_blocks_total

    async def body() -> None:
        got_two, leave = asyncio.Event(), asyncio.Event()

        async def consume() -> None:
            n = 0
            async with aclosing(
                ae.generate(EngineRequest("long", prompts(1, [30])[0], long))
            ) as stream:
                async for _ in stream:
                    n += 1
                    if n == 2:
                        got_two.set()
                        if how == "aclose":
                            await leave.wait()
                            return  # leaving the block closes the stream early

        task = asyncio.create_task(consume())
        await got_two.wait()
        busy = await ae.call(lambda e: e.stats())
        assert busy.num_running == 1 and busy.num_blocks_free < total
        if how == "aclose":
            leave.set()
            await task
        else:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # The abort was queued before this call, so the engine has run it by now.
        after = await ae.call(lambda e: e.stats())
        assert (after.num_running, after.num_waiting, after.num_blocks_free) == (0, 0, total)
        await ae.close()

    run(body)
    ae.engine.check_no_leaks()
    assert ae.stats().num_blocks_free == total  # the final snapshot agrees


def test_batch_window_prefills_requests_together(tiny_llama_dir: Path) -> None:
    first, second = prompts(2, [9, 14])
    # The window would last an hour; the token budget (both prompts exactly) ends it as soon
    # as the second request is queued, so this test finishes only if that works.
    engine = load(tiny_llama_dir, max_num_batched_tokens=len(first) + len(second), max_num_seqs=4)
    ae = AsyncEngine(engine, batch_window_ms=3_600_000, adaptive_window=False)
    ae.start()
    one = SamplingParams(temperature=0.0, max_tokens=1)

    async def body() -> None:
        steps_before = ae.snapshot().num_steps
        a = asyncio.create_task(collect(ae, "a", first, one))
        # Commands run in order, so once a call sees "a" waiting, "a" reached the engine;
        # the window keeps it from running alone.
        seen = await ae.call(lambda e: e.stats())
        while seen.num_waiting == seen.num_running == 0 and ae.snapshot().num_steps == steps_before:
            seen = await ae.call(lambda e: e.stats())
        assert (seen.num_waiting, seen.num_running) == (1, 0)
        assert ae.snapshot().num_steps == steps_before
        outs_b = await collect(ae, "b", second, one)
        outs_a = await a
        assert len(outs_a) == len(outs_b) == 1
        await ae.call(lambda e: None)
        assert ae.snapshot().num_steps == steps_before + 1  # one step prefilled both
        await ae.close()

    run(body)
    ae.engine.check_no_leaks()


def test_lone_request_runs_when_window_ends(tiny_llama_dir: Path) -> None:
    ae = AsyncEngine(load(tiny_llama_dir), batch_window_ms=20)
    ae.start()
    ref = load(tiny_llama_dir).generate(prompts(3, [7]), GREEDY)[0]

    async def body() -> None:
        outs = await collect(ae, "solo", prompts(3, [7])[0], GREEDY)
        assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
        await ae.close()

    run(body)


def test_errors_reach_the_caller_and_spare_others(tiny_llama_dir: Path) -> None:
    ae = AsyncEngine(load(tiny_llama_dir))
    ae.start()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def body() -> None:
        with pytest.raises(InvalidArgumentError, match="prompt_token_ids"):
            await collect(ae, "empty", [], params)
        with pytest.raises(InvalidArgumentError, match="prompt_token_ids"):
            await collect(ae, "oov", [1, 10**6], params)
        # A duplicate id fails without aborting the request that holds the id.
        stream = ae.generate(EngineRequest("dup", prompts(4, [10])[0], params))
        async with aclosing(stream):
            first = await anext(stream)
            with pytest.raises(DuplicateRequestError):
                await collect(ae, "dup", [1, 2, 3], params)
            rest = [o async for o in stream]
        assert len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest) == 8
        await ae.close()
        with pytest.raises(WorkerUnavailableError):
            await collect(ae, "late", [1, 2], params)

    run(body)
    ae.engine.check_no_leaks()


def test_hold_kv_export_and_release(tiny_llama_dir: Path) -> None:
    ae = AsyncEngine(load(tiny_llama_dir))
    ae.start()
    prompt = prompts(5, [37])[0]
    total = ae.stats().num_blocks_total

    async def body() -> None:
        outs = [
            o
            async for o in ae.generate(
                EngineRequest("h", prompt, SamplingParams(max_tokens=1)), hold_kv=True
            )
        ]
        assert outs[-1].finished
        held = await ae.call(lambda e: e.stats())
        assert held.num_held == 1 and held.num_blocks_free < total
        payload = await ae.export_and_release("h")
        assert payload.num_tokens == len(prompt)
        after = await ae.call(lambda e: e.stats())
        assert (after.num_held, after.num_blocks_free) == (0, total)
        await ae.close()

    run(body)
    ae.engine.check_no_leaks()


def test_close_aborts_in_flight_requests(tiny_llama_dir: Path) -> None:
    ae = AsyncEngine(load(tiny_llama_dir))
    ae.start()
    long = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)

    async def body() -> None:
        stream = ae.generate(EngineRequest("long", prompts(6, [12])[0], long))
        async with aclosing(stream):
            await anext(stream)
            await ae.close()
            with pytest.raises(WorkerUnavailableError):
                async for _ in stream:
                    pass

    run(body)
    ae.engine.check_no_leaks()


def test_adaptive_window_does_not_hold_a_lone_request(tiny_llama_dir: Path) -> None:
    """One-at-a-time traffic never waits: with an hour-long window this finishes only if so."""
    ae = AsyncEngine(load(tiny_llama_dir), batch_window_ms=3_600_000)
    ae.start()

    async def body() -> None:
        for i in range(3):
            outs = await collect(ae, f"solo{i}", prompts(5 + i, [6])[0], GREEDY)
            assert outs[-1].finished
        await ae.close()

    run(body)
    ae.engine.check_no_leaks()


def test_layer_hook_sees_each_layer_of_the_whole_prompt_once(tiny_llama_dir: Path) -> None:
    """The hook runs on the engine thread, once per layer, with the prompt's K and V: the same
    values ``export_kv`` reads afterwards (chunked prefill: earlier chunks included)."""
    ae = AsyncEngine(load(tiny_llama_dir, max_num_batched_tokens=16, max_num_seqs=4))
    ae.start()
    prompt = prompts(7, [37])[0]
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    threads: set[str] = set()

    def hook(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        threads.add(threading.current_thread().name)
        assert layer not in seen
        seen[layer] = (keys.clone(), values.clone())  # views: valid only during the call

    async def body() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=1)
        stream = ae.generate(EngineRequest("hooked", prompt, params), hold_kv=True, layer_hook=hook)
        async with aclosing(stream):
            async for _ in stream:
                pass
        payload = await ae.export_and_release("hooked")
        assert sorted(seen) == list(range(payload.layout.num_layers))
        for layer, (k, v) in seen.items():
            # the export is numpy in the wire dtype (``kv_arrays``): viewed back to compare
            keys, values = payload.keys[layer], payload.values[layer]
            assert torch.equal(k, as_tensor(keys, k.dtype)) and torch.equal(
                v, as_tensor(values, v.dtype)
            )
        await ae.close()

    run(body)
    assert threads == {"engine-loop"}
    ae.engine.check_no_leaks()


def test_held_kv_is_released_when_its_consumer_leaves_before_the_end(tiny_llama_dir: Path) -> None:
    """A hold_kv request finishes on the engine thread while its consumer is being cancelled
    (it never reads the last output): the abort must still release the held blocks."""
    ae = AsyncEngine(load(tiny_llama_dir))
    ae.start()
    total = ae.stats().num_blocks_total

    async def body() -> None:
        stream = ae.generate(
            EngineRequest("held", prompts(8, [40])[0], SamplingParams(max_tokens=1)), hold_kv=True
        )
        task = asyncio.create_task(anext(stream))
        await asyncio.sleep(0)  # let the task submit the request (one loop turn, no waiting)
        # Block this loop (bounded) until the engine has finished and holds the request, so
        # that the task cannot have read the final output when it is cancelled.
        deadline = time.monotonic() + 30
        while ae.snapshot().stats.num_held == 0:
            assert time.monotonic() < deadline, "the request never finished"
            time.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()
        after = await ae.call(lambda e: e.stats())  # queued after the abort
        assert (after.num_held, after.num_blocks_free) == (0, total)
        await ae.close()

    run(body)
    ae.engine.check_no_leaks()


def test_coalesce_merges_what_waited_and_sends_the_first_output_alone(
    tiny_llama_dir: Path,
) -> None:
    (prompt,) = prompts(7, [17])
    (reference,) = load(tiny_llama_dir).generate([prompt], GREEDY)
    ae = AsyncEngine(load(tiny_llama_dir))
    ae.start()

    async def body() -> None:
        try:
            async with aclosing(
                ae.generate(EngineRequest("c", prompt, GREEDY), coalesce=True)
            ) as stream:
                first = await anext(stream)
                # Read nothing until the engine has run the request to its end: every later
                # output is then waiting in the queue.
                while await ae.call(lambda engine: engine.has_unfinished()):
                    pass
                rest = [out async for out in stream]
        finally:
            await ae.close()
        assert len(first.new_token_ids) == 1 and not first.finished
        (merged,) = rest  # everything that waited came as one output
        assert merged.finished and merged.finish_reason is FinishReason.LENGTH
        assert first.new_token_ids + merged.new_token_ids == reference.token_ids
        assert first.new_logprobs + merged.new_logprobs == pytest.approx(reference.logprobs)

    run(body)


def test_batch_window_opens_for_bursts_and_ends_when_the_step_is_full() -> None:
    """The window's policy alone: adaptive, it opens only once arrivals came in bursts; its
    wait ends as soon as the step is full (an hour-long window: only then does this end),
    and a stop command ends it with False."""
    assert not BatchWindow(0.0, adaptive=False).opens
    assert BatchWindow(10.0, adaptive=False).opens
    window = BatchWindow(3_600_000)
    for _ in range(3):  # one request per step: nothing to wait for
        window.added()
        window.stepped()
        assert not window.opens
    for _ in range(4):  # requests arrive three at a time
        for _ in range(3):
            window.added()
        window.stepped()
    assert window.opens
    with pytest.raises(InvalidArgumentError, match="batch_window_ms"):
        BatchWindow(-1.0)

    commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
    for i in range(5):
        commands.put(AbortCommand(f"r{i}", None))
    applied: list[Command] = []

    def apply(command: Command) -> bool:
        applied.append(command)
        return not isinstance(command, StopCommand)

    assert window.gather(commands, apply, lambda: len(applied) >= 2)
    assert len(applied) == 2 and commands.qsize() == 3
    commands.put(StopCommand())
    assert not window.gather(commands, apply, lambda: False)
    assert isinstance(applied[-1], StopCommand) and commands.empty()


def test_an_idle_engine_hands_freed_heap_back_once_per_busy_stretch(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine thread trims the heap when it falls idle after starting and after stepping,
    once each time: not on every idle wait."""
    import pdserve.engine_loop.async_engine as module

    trims: queue.SimpleQueue[str] = queue.SimpleQueue()
    monkeypatch.setattr(module, "trim_heap", lambda: trims.put(threading.current_thread().name))
    monkeypatch.setattr(module, "TRIM_AFTER_S", 0.05)
    ae = AsyncEngine(load(tiny_llama_dir))
    ae.start()

    async def body() -> None:
        try:
            engine_thread = trims.get(timeout=30)  # start-up's garbage, before any request
            assert engine_thread != threading.current_thread().name
            outs = await collect(ae, "r0", prompts(1, [9])[0], GREEDY)
            assert outs[-1].finished
            assert trims.get(timeout=30) == engine_thread  # the busy stretch's, once idle
            await ae.call(lambda engine: None)  # an idle command that steps nothing
        finally:
            await ae.close()
        assert trims.empty()  # nothing stepped since the last trim: no second one

    run(body)
