"""``PrefillWorker`` on its own: a real engine backend (the tiny checkpoint), and a KV store
client that is never dialled (the shm and recompute hand-offs need no store), so only the
worker's own logic is under test: its checks, its hand-off and the timing it derives."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.backends import TORCH
from pdserve.engine.outputs import FinishReason
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.handoff import HandoffRoute, PrefillConnector
from pdserve.kvstore.client import KVStoreClient
from pdserve.transfer.base import TransportKind
from pdserve.worker.prefill import PrefillWorker
from tests.unit.backends.conftest import open_backend, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = (7, 300, 41, 1000, 5, 5, 12, 99, 1500, 3, 8)
HOST = "h"


@pytest.fixture(autouse=True)
def no_segment_left() -> Iterator[None]:
    """A prefill whose KV no decode worker reads leaves its shm segment for the janitor;
    remove this process's here so that no test leaves one behind."""
    yield
    for leftover in Path("/dev/shm").glob(f"pdserve-kv-{os.getpid()}-*"):
        leftover.unlink(missing_ok=True)


def test_prefill_hands_over_through_shm_with_the_engines_first_token(
    tiny_llama_dir: Path,
) -> None:
    async def body() -> None:
        async with open_backend(TORCH, tiny_llama_dir) as engine:
            store = KVStoreClient("127.0.0.1:1", timeout_s=1)  # never dialled
            worker = PrefillWorker(engine, PrefillConnector(engine, store, host=HOST))
            try:
                whole = [t async for o in engine.generate(EngineRequest("w", PROMPT, GREEDY))
                         for t in o.new_token_ids]  # fmt: skip
                result = await worker.prefill(
                    EngineRequest("r-shm", PROMPT, GREEDY), HandoffRoute("", HOST, "shm")
                )
                assert result.first_token_id == whole[0]
                assert result.finish_reason is None
                assert result.kv is not None and result.kv.kind is TransportKind.SHM
                assert result.kv.num_tokens == len(PROMPT)
                assert result.transfer is not None and result.transfer.transport == "shm"
                # The figures are derived from the stamps, in one place.
                assert result.stamps is not None
                assert result.timing.queue_ms == result.stamps.queue_ms
                assert result.timing.prefill_ms == result.stamps.first_output_ms
                assert result.timing.transfer_bytes == result.transfer.num_bytes > 0
                assert result.timing.transfer_ms == result.transfer.exposed_ms
            finally:
                await worker.close()  # frees the shm slot the KV waits in
                await store.close()

    run(body)


def test_recompute_sends_nothing(tiny_llama_dir: Path) -> None:
    async def body() -> None:
        async with open_backend(TORCH, tiny_llama_dir) as engine:
            store = KVStoreClient("127.0.0.1:1", timeout_s=1)
            worker = PrefillWorker(engine, PrefillConnector(engine, store, host=HOST))
            try:
                result = await worker.prefill(
                    EngineRequest("r-rc", PROMPT, GREEDY), HandoffRoute(transport="recompute")
                )
                assert result.kv is not None and result.kv.kind is TransportKind.RECOMPUTE
                assert result.timing.transfer_bytes == 0
                assert result.transfer is not None
                assert result.transfer.fallback_reason == "recompute was asked for"
            finally:
                await worker.close()
                await store.close()

    run(body)


def test_a_request_that_ends_at_its_first_token_hands_nothing_over(tiny_llama_dir: Path) -> None:
    async def body() -> None:
        async with open_backend(TORCH, tiny_llama_dir) as engine:
            store = KVStoreClient("127.0.0.1:1", timeout_s=1)
            worker = PrefillWorker(engine, PrefillConnector(engine, store, host=HOST))
            try:
                one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
                result = await worker.prefill(
                    EngineRequest("r-one", PROMPT, one), HandoffRoute("", HOST, "shm")
                )
                assert result.finish_reason is FinishReason.LENGTH
                assert result.kv is None and result.timing.transfer_bytes == 0
            finally:
                await worker.close()
                await store.close()

    run(body)


@pytest.mark.parametrize(
    ("request_id", "prompt", "transport", "field"),
    [
        ("", PROMPT, "", "request_id"),
        ("r", [], "", "prompt_token_ids"),
        ("r", [1, 10**9], "", "prompt_token_ids"),
        ("r", PROMPT, "carrier-pigeon", "transport"),
    ],
)
def test_bad_requests_are_refused_by_field(
    tiny_llama_dir: Path, request_id: str, prompt: list[int], transport: str, field: str
) -> None:
    async def body() -> None:
        async with open_backend(TORCH, tiny_llama_dir) as engine:
            store = KVStoreClient("127.0.0.1:1", timeout_s=1)
            worker = PrefillWorker(engine, PrefillConnector(engine, store, host=HOST))
            try:
                with pytest.raises(InvalidArgumentError) as err:
                    await worker.prefill(
                        EngineRequest(request_id, tuple(prompt), GREEDY),
                        HandoffRoute(transport=transport),
                    )
                assert err.value.field == field
            finally:
                await worker.close()
                await store.close()

    run(body)
