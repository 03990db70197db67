"""The contract every ``EngineBackend`` keeps, run against each backend (conftest
``backend_kind``): the torch backend on pdserve's engine, the tensorrt-llm backend on the
stand-in ``tensorrt_llm`` package (tests/fakes), which computes with pdserve's engine too,
and the sim backend, whose engine spends modelled time and draws deterministic tokens.

The same greedy tokens whichever way a request runs: whole, prefilled then decoded from the
handed-over KV (the backend's own kind of hand-off), or decoded with nothing handed over
(recompute); and, for these exact float32 backends, the tokens of the engine alone. Then the
capacity a heartbeat reads, aborts, and the clear refusal of what a backend cannot do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
from contextlib import aclosing
from pathlib import Path

import pytest

from pdserve.backends import (
    BACKEND_NAMES,
    TENSORRT_LLM,
    EngineBackend,
    Handoff,
    NativeKV,
    Prefilled,
)
from pdserve.backends.tensorrt_llm_sampling import unsupported
from pdserve.engine.kv_payload import KVPayload
from pdserve.engine.outputs import FinishReason, RequestOutput
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import DuplicateRequestError, InvalidArgumentError, WorkerUnavailableError
from tests.unit.backends.conftest import open_backend, reference_engine, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompts(seed: int, lengths: list[int], vocab: int = 2048) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]


async def collect(stream: object) -> tuple[list[int], list[float], list[RequestOutput]]:
    tokens: list[int] = []
    logprobs: list[float] = []
    outs: list[RequestOutput] = []
    async with aclosing(stream) as s:  # type: ignore[type-var]
        async for out in s:
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
            outs.append(out)
    return tokens, logprobs, outs


def handoff_of(backend: EngineBackend) -> Handoff:
    """The backend's own kind of hand-off: KV bytes held for export, or its native transfer."""
    return Handoff.NATIVE if backend.features.native_kv else Handoff.HOLD


async def handed_over(
    backend: EngineBackend, prefilled: Prefilled, rid: str
) -> KVPayload | NativeKV:
    if prefilled.native is not None:
        return prefilled.native
    return await backend.export_kv(rid)


_settles = itertools.count()


async def barrier(backend: EngineBackend) -> None:
    """Wait until ``capacity()`` reflects everything the backend was told and answered so far.

    A one-token request queues behind what came before (an abort included), and the torch
    engine publishes its capacity after the step that computes it, just after handing out its
    output; a call after that output runs on the engine thread once that publish is done.
    """
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    await collect(backend.generate(EngineRequest(f"settle-{next(_settles)}", [5, 6], one)))
    await backend.cached_prefix_blocks([])


def test_is_an_engine_backend(backend_kind: str, tiny_llama_dir: Path) -> None:
    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            assert isinstance(backend, EngineBackend)
            assert backend.name == backend_kind and backend.name in BACKEND_NAMES
            assert backend.vocab_size == 2048
            assert backend.max_model_len > 100 and backend.max_num_batched_tokens > 0
            assert backend.layout.num_layers == 4
            # The sim's KV is a stand-in of one value per token and layer.
            assert backend.layout.num_kv_heads == (1 if backend_kind == "sim" else 2)
            assert backend.kv_bytes_per_token == 4 * 2 * 2 * 32 * 4  # the modelled fp32 tiny
            assert backend.fingerprint

    run(body)


def test_fingerprints_keep_backends_apart(fake_tensorrt_llm: Path, tiny_llama_dir: Path) -> None:
    """KV moves only between equal fingerprints: a torch and a tensorrt-llm worker of one
    checkpoint must not be paired."""

    async def body() -> None:
        async with (
            open_backend("torch", tiny_llama_dir) as torch_backend,
            open_backend("tensorrt-llm", tiny_llama_dir) as trt_backend,
        ):
            assert torch_backend.fingerprint != trt_backend.fingerprint
            assert trt_backend.fingerprint.startswith("tensorrt-llm/")

    run(body)


def test_generate_matches_the_engine_alone(backend_kind: str, tiny_llama_dir: Path) -> None:
    ps = prompts(1, [6, 23, 41])
    reference = reference_engine(backend_kind, tiny_llama_dir).generate(ps, GREEDY)

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            got = await asyncio.gather(
                *(
                    collect(backend.generate(EngineRequest(f"g{i}", p, GREEDY)))
                    for i, p in enumerate(ps)
                )
            )
        for ref, (tokens, logprobs, outs) in zip(reference, got, strict=True):
            assert tokens == ref.token_ids
            assert logprobs == pytest.approx(ref.logprobs, abs=1e-4)
            assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
            assert all(not o.finished for o in outs[:-1])

    run(body)


def test_prefill_then_decode_equals_whole(backend_kind: str, tiny_llama_dir: Path) -> None:
    """Greedy parity between the whole request and prefill + hand-off + decode."""
    ps = prompts(2, [5, 17, 33])

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            for i, p in enumerate(ps):
                whole, whole_lps, _ = await collect(
                    backend.generate(EngineRequest(f"w{i}", p, GREEDY))
                )
                pre = await backend.prefill(
                    EngineRequest(f"s{i}", p, GREEDY), handoff=handoff_of(backend)
                )
                first = (pre.output.new_token_ids[0], pre.output.new_logprobs[0])
                assert pre.output.finished and pre.output.finish_reason is FinishReason.LENGTH
                kv = await handed_over(backend, pre, f"s{i}")
                rest, rest_lps, outs = await collect(
                    backend.decode(EngineRequest(f"s{i}", p, GREEDY), first, kv)
                )
                assert [first[0], *rest] == whole
                assert [first[1], *rest_lps] == pytest.approx(whole_lps, abs=1e-4)
                assert outs[-1].finish_reason is FinishReason.LENGTH

    run(body)


def test_decode_without_kv_recomputes(backend_kind: str, tiny_llama_dir: Path) -> None:
    """Nothing handed over: the backend computes the prompt itself and continues after the
    given first token."""
    p = prompts(3, [19])[0]

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            whole, _, _ = await collect(backend.generate(EngineRequest("w", p, GREEDY)))
            rest, _, outs = await collect(
                backend.decode(EngineRequest("r", p, GREEDY), (whole[0], 0.0), None)
            )
            assert rest == whole[1:]
            assert outs[-1].finish_reason is FinishReason.LENGTH

    run(body)


def test_decode_of_a_one_token_request_ends_at_once(
    backend_kind: str, tiny_llama_dir: Path
) -> None:
    """``max_tokens`` counts the prefill's first token: with 1 there is nothing to decode."""

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            one = SamplingParams(temperature=0.0, max_tokens=1)
            outs = [
                o async for o in backend.decode(EngineRequest("x", [5, 6, 7], one), (8, 0.0), None)
            ]
            assert len(outs) == 1 and outs[0].new_token_ids == []
            assert outs[0].finish_reason is FinishReason.LENGTH

    run(body)


def test_a_migrated_request_continues_after_its_tokens(
    backend_kind: str, tiny_llama_dir: Path
) -> None:
    """``generated``: output tokens another engine drew (they count in ``max_tokens``); the
    stream carries only the tokens after them, greedy ones as the whole request drew them."""
    p = prompts(9, [14])[0]

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            whole, _, _ = await collect(backend.generate(EngineRequest("w", p, GREEDY)))
            rest, _, outs = await collect(
                backend.generate(EngineRequest("m", p, GREEDY), generated=whole[:4])
            )
            assert rest == whole[4:]
            assert outs[-1].finish_reason is FinishReason.LENGTH

    run(body)


def test_a_stop_token_ends_the_prefill(backend_kind: str, tiny_llama_dir: Path) -> None:
    """A first token that stops the request finishes it: nothing is left to hand over."""
    p = prompts(4, [12])[0]

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            whole, _, _ = await collect(backend.generate(EngineRequest("w", p, GREEDY)))
            stopping = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(whole[0],))
            pre = await backend.prefill(
                EngineRequest("s", p, stopping), handoff=handoff_of(backend)
            )
            assert pre.output.new_token_ids == [whole[0]]
            assert pre.output.finish_reason is FinishReason.STOP
            assert pre.native is None
            if not backend.features.native_kv:
                backend.abort("s")  # frees the held KV
            await barrier(backend)
            assert backend.capacity().running == 0

    run(body)


def test_logits_controls_hold_on_every_path(backend_kind: str, tiny_llama_dir: Path) -> None:
    """A +100 ``logit_bias`` forces its token and ``min_tokens`` holds back a stop token that
    would end the request at once, whole and across a hand-off (the prefill draws the first
    token, the decode side the rest); ``allowed_token_ids`` keeps every token in the list. A
    backend that cannot honour a control refuses it by name (tensorrt-llm: ``unsupported``)."""
    p = prompts(10, [13])[0]

    def refusal(backend: EngineBackend, params: SamplingParams) -> str | None:
        why = unsupported(params) if backend.name == TENSORRT_LLM else None
        return None if why is None else why[0]

    async def both_ways(
        backend: EngineBackend, rid: str, params: SamplingParams
    ) -> list[list[int]]:
        """The tokens of the whole request, and of prefill + hand-off + decode; or the refusal
        of each, checked to name its field."""
        field = refusal(backend, params)
        if field is not None:
            with pytest.raises(InvalidArgumentError) as err:
                await collect(backend.generate(EngineRequest(f"{rid}-w", p, params)))
            assert err.value.field == field
            return []
        whole, _, _ = await collect(backend.generate(EngineRequest(f"{rid}-w", p, params)))
        pre = await backend.prefill(
            EngineRequest(f"{rid}-s", p, params), handoff=handoff_of(backend)
        )
        first = pre.output.new_token_ids[0]
        kv = await handed_over(backend, pre, f"{rid}-s")
        rest, _, _ = await collect(
            backend.decode(EngineRequest(f"{rid}-s", p, params), (first, 0.0), kv)
        )
        return [whole, [first, *rest]]

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            plain, _, _ = await collect(backend.generate(EngineRequest("plain", p, GREEDY)))
            forced = plain[3]  # a token that greedy draws, but not first
            biased = SamplingParams(
                temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={forced: 100.0}
            )
            for tokens in await both_ways(backend, "bias", biased):
                assert tokens == [forced] * 5
            stop = plain[0]  # ends a request at once, but for min_tokens
            held = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop,))
            assert (await collect(backend.generate(EngineRequest("stops", p, held))))[0] == [stop]
            held = dataclasses.replace(held, min_tokens=3)
            for tokens in await both_ways(backend, "min", held):
                assert len(tokens) >= 3 and stop not in tokens[:3], tokens
            allowed = SamplingParams(
                temperature=0.0, max_tokens=6, ignore_eos=True, allowed_token_ids=(plain[5], 77)
            )
            for tokens in await both_ways(backend, "allowed", allowed):
                assert set(tokens) <= {plain[5], 77} and len(tokens) == 6
            await barrier(backend)
            assert backend.capacity().running == 0

    run(body)


def test_capacity_follows_requests(backend_kind: str, tiny_llama_dir: Path) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    p = prompts(5, [9])[0]

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            idle = backend.capacity()
            assert idle.blocks_total > 0 and idle.block_size > 0
            assert 0 <= idle.blocks_free <= idle.blocks_total
            assert (idle.running, idle.waiting, idle.queued_tokens, idle.tags) == (0, 0, 0, ())
            stream = backend.generate(EngineRequest("c", p, long, reservation_id="resv-7"))
            async with aclosing(stream):
                first = await anext(stream)
                assert first.new_token_ids and not first.finished
                await barrier(backend)
                busy = backend.capacity()
                assert busy.tags == ("resv-7",)
                assert busy.running == 1 and busy.waiting == 0
            # Closed early: the request is aborted and forgotten; its id is free again, and
            # the engine still computes the same tokens.
            again, _, _ = await collect(backend.generate(EngineRequest("c", p, GREEDY)))
            other, _, _ = await collect(backend.generate(EngineRequest("d", p, GREEDY)))
            assert again == other and len(again) == GREEDY.max_tokens
            await barrier(backend)
            after = backend.capacity()
            assert after.tags == () and after.running == 0 and after.waiting == 0

    run(body)


def test_abort_frees_held_kv(backend_kind: str, tiny_llama_dir: Path) -> None:
    """A held prefill keeps its blocks until ``abort``; aborting an unknown id is a no-op."""
    p = prompts(6, [40])[0]

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            backend.abort("nobody")
            if not backend.features.kv_payload:
                assert backend.capacity().running == 0
                return
            await barrier(backend)
            total = backend.capacity().blocks_total
            await backend.prefill(EngineRequest("h", p, GREEDY), handoff=Handoff.HOLD)
            await barrier(backend)
            assert backend.capacity().blocks_free <= total - 2  # 41 tokens in blocks of 16
            backend.abort("h")
            await barrier(backend)
            assert backend.capacity().blocks_free == total

    run(body)


def test_hand_back_ends_running_streams_and_keeps_held_kv(
    backend_kind: str, tiny_llama_dir: Path
) -> None:
    """``hand_back`` ends a running stream with ``WorkerUnavailableError`` naming why (the
    router migrates it), frees its KV and forgets it; a held prefill keeps its blocks."""
    long = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    p, q = prompts(11, [9, 40])

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            await barrier(backend)
            total = backend.capacity().blocks_total
            holds = backend.features.kv_payload
            if holds:
                await backend.prefill(EngineRequest("held", q, GREEDY), handoff=Handoff.HOLD)
            stream = backend.generate(EngineRequest("running", p, long))
            async with aclosing(stream):
                first = await anext(stream)
                assert first.new_token_ids and not first.finished
                backend.hand_back("leaving decode duty")
                with pytest.raises(WorkerUnavailableError, match="leaving decode duty"):
                    async for _ in stream:
                        pass
            await barrier(backend)
            after = backend.capacity()
            assert after.running == 0 and after.waiting == 0
            if holds:
                assert after.blocks_free <= total - 2  # the held prefill's 41 tokens
                backend.abort("held")
                await barrier(backend)
                assert backend.capacity().blocks_free == total
            # The id is free again, and the engine computes as before.
            again, _, _ = await collect(backend.generate(EngineRequest("running", p, GREEDY)))
            assert len(again) == GREEDY.max_tokens

    run(body)


def test_a_request_id_in_flight_is_refused(backend_kind: str, tiny_llama_dir: Path) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    p = prompts(7, [8])[0]

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            stream = backend.generate(EngineRequest("dup", p, long))
            async with aclosing(stream):
                await anext(stream)
                with pytest.raises(DuplicateRequestError):
                    await collect(backend.generate(EngineRequest("dup", p, GREEDY)))

    run(body)


def test_closed_backend_refuses_work(backend_kind: str, tiny_llama_dir: Path) -> None:
    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            pass
        await backend.close()  # idempotent
        with pytest.raises(WorkerUnavailableError):
            await collect(backend.generate(EngineRequest("late", [5, 6, 7], GREEDY)))

    run(body)


def test_what_a_backend_cannot_do_is_refused_by_field(
    backend_kind: str, tiny_llama_dir: Path
) -> None:
    """No silent fallback: each refusal is an InvalidArgumentError naming what asked for it."""
    p = prompts(8, [10])[0]

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            f = backend.features
            if not f.native_kv:
                with pytest.raises(InvalidArgumentError) as err:
                    await backend.prefill(EngineRequest("n", p, GREEDY), handoff=Handoff.NATIVE)
                assert err.value.field == "transport"
                native = NativeKV(backend="tensorrt-llm", ctx_request_id=1, first_gen_tokens=(5,))
                with pytest.raises(InvalidArgumentError) as err:
                    await collect(backend.decode(EngineRequest("n", p, GREEDY), (5, 0.0), native))
                assert err.value.field == "kv.native"
            if not f.kv_payload:
                with pytest.raises(InvalidArgumentError) as err:
                    await backend.prefill(EngineRequest("h", p, GREEDY), handoff=Handoff.HOLD)
                assert err.value.field == "transport"
                with pytest.raises(InvalidArgumentError) as err:
                    await backend.export_kv("h")
                assert err.value.field == "kv.location"
                payload = _payload_for(backend, len(p))
                with pytest.raises(InvalidArgumentError) as err:
                    await collect(backend.decode(EngineRequest("h", p, GREEDY), (5, 0.0), payload))
                assert err.value.field == "kv.location"
            if not f.layer_hook:
                with pytest.raises(InvalidArgumentError) as err:
                    await backend.prefill(
                        EngineRequest("l", p, GREEDY),
                        handoff=Handoff.RELEASE,
                        layer_hook=lambda *a: None,
                    )
                assert err.value.field == "transport"
            if not f.prefix_cache:
                assert await backend.cached_prefix_blocks([b"\x00" * 32]) == 0
                assert await backend.export_cached_prefix([b"\x00" * 32]) is None
            assert backend.capacity().running == 0  # nothing was left behind

    run(body)


def _payload_for(backend: EngineBackend, num_tokens: int) -> KVPayload:
    import torch

    lay = backend.layout
    shape = (num_tokens, lay.num_kv_heads, lay.head_dim)
    zeros = tuple(torch.zeros(shape) for _ in range(lay.num_layers))
    return KVPayload(lay, num_tokens, zeros, zeros)
