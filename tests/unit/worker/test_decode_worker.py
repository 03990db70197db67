"""``DecodeWorker`` on its own: real engine backends (the tiny checkpoint), a prefill worker's
shm hand-off in-process, or no hand-off at all (recompute, colocated): the tokens are those
of the whole request run on one engine, and the last delta carries the derived timing with
the stamps and the transfer record it came from."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.backends import TORCH, EngineBackend
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError, KVPayloadMismatchError
from pdserve.handoff import DecodeConnector, HandoffRoute, PrefillConnector
from pdserve.kvstore.client import KVStoreClient
from pdserve.transfer.base import KVLocation, TransportKind
from pdserve.worker.decode import DecodeWorker
from pdserve.worker.delta import DecodeDelta
from pdserve.worker.prefill import PrefillWorker
from tests.unit.backends.conftest import open_backend, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = (7, 300, 41, 1000, 5, 5, 12, 99, 1500, 3, 8)
HOST = "h"


async def whole(engine: EngineBackend, rid: str) -> list[int]:
    return [
        t
        async for o in engine.generate(EngineRequest(rid, PROMPT, GREEDY))
        for t in o.new_token_ids
    ]


def tokens_of(deltas: list[DecodeDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


@pytest.mark.parametrize("transport", ["shm", "recompute"])
def test_decode_after_a_hand_off_gives_the_whole_requests_tokens(
    tiny_llama_dir: Path, transport: str
) -> None:
    async def body() -> None:
        async with (
            open_backend(TORCH, tiny_llama_dir) as p_engine,
            open_backend(TORCH, tiny_llama_dir) as d_engine,
        ):
            store = KVStoreClient("127.0.0.1:1", timeout_s=1)  # never dialled
            prefill = PrefillWorker(p_engine, PrefillConnector(p_engine, store, host=HOST))
            decode = DecodeWorker(d_engine, DecodeConnector(d_engine, host=HOST))
            try:
                expected = await whole(d_engine, "w")
                request = EngineRequest(f"r-{transport}", PROMPT, GREEDY)
                result = await prefill.prefill(request, HandoffRoute("", HOST, transport))
                assert result.kv is not None
                first = (result.first_token_id, result.first_logprob)
                deltas = [d async for d in decode.decode(request, first, result.kv)]
                assert [first[0], *tokens_of(deltas)] == expected
                assert all(d.finished is None for d in deltas[:-1])
                last = deltas[-1].finished
                assert last is not None and deltas[-1].finish_reason is not None
                assert last.transfer is not None and last.transfer.transport == transport
                assert last.timing.transport == transport
                assert last.timing.queue_ms == last.stamps.queue_ms
                assert last.timing.decode_ms == last.stamps.steps_ms
                if transport == "shm":
                    assert last.timing.transfer_bytes == last.transfer.num_bytes > 0
                    assert last.timing.prefill_ms == 0.0  # nothing recomputed here
            finally:
                await prefill.close()
                await decode.close()
                await store.close()

    run(body)


def test_generate_runs_the_whole_request_here(tiny_llama_dir: Path) -> None:
    async def body() -> None:
        async with open_backend(TORCH, tiny_llama_dir) as engine:
            decode = DecodeWorker(engine, DecodeConnector(engine, host=HOST))
            try:
                expected = await whole(engine, "w")
                deltas = [d async for d in decode.generate(EngineRequest("g", PROMPT, GREEDY))]
                assert tokens_of(deltas) == expected
                last = deltas[-1].finished
                assert last is not None and last.transfer is None
                assert last.timing.prefill_ms == last.stamps.first_output_ms
                assert last.timing.ttft_ms == last.stamps.ttft_ms
                assert last.timing.e2e_ms == last.stamps.e2e_ms
            finally:
                await decode.close()

    run(body)


def test_kv_of_another_model_is_refused(tiny_llama_dir: Path) -> None:
    async def body() -> None:
        async with open_backend(TORCH, tiny_llama_dir) as engine:
            decode = DecodeWorker(engine, DecodeConnector(engine, host=HOST))
            try:
                request = EngineRequest("r", PROMPT, GREEDY)
                foreign = KVLocation(
                    TransportKind.SHM, "r", len(PROMPT), 10, "another-model",
                    key="seg", host=HOST, capability=bytes(16),
                )  # fmt: skip
                with pytest.raises((KVPayloadMismatchError, InvalidArgumentError)):
                    async for _ in decode.decode(request, (1, 0.0), foreign):
                        pass
                mismatched = KVLocation(
                    TransportKind.RECOMPUTE, "r", len(PROMPT) + 1, 0, decode.fingerprint
                )
                with pytest.raises(InvalidArgumentError) as err:
                    async for _ in decode.decode(request, (1, 0.0), mismatched):
                        pass
                assert err.value.field == "kv.num_tokens"
            finally:
                await decode.close()

    run(body)
