"""RequestFlow when workers fail it: a failed prefill is placed again away from the worker
that failed it, and a decode stream that breaks mid-way migrates with the tokens already sent
(scripted in-process services of ``router/test_flow``)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from pdserve.engine.outputs import FinishReason
from pdserve.errors import InvalidArgumentError
from pdserve.router import FlowConfig, RequestFlow, RouteChunk
from pdserve.router.downstream import DownstreamError
from pdserve.router.failover import HANDBACK_LIMIT
from pdserve.tokenizer import Tokenizer
from tests.unit.router.test_flow import DECODED, FIRST, Fakes, _collect, _request, run_with_fakes


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def test_a_failed_prefill_is_placed_again_elsewhere(tokenizer: Tokenizer) -> None:
    got: list[RouteChunk] = []

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        got.extend(await _collect(flow, _request(tokenizer), timeout_s=30))

    def configure(f: Fakes) -> None:
        f.prefill_failures = 2

    fakes = run_with_fakes(tokenizer, configure, body)
    assert [t for c in got for t in c.token_ids] == [FIRST, *DECODED]
    assert got[-1].usage is not None and got[-1].usage.completion_tokens == 4
    # Each placement excludes every worker that failed the request so far.
    assert [list(r.exclude) for r in fakes.assign_requests] == [[], ["w0"], ["w0", "w1"]]
    assert not any(r.decode_only for r in fakes.assign_requests)
    # The failed attempts' reservations went back whole; the last one as usual.
    assert sorted(fakes.released) == [
        ("res-0", False), ("res-1", False), ("res-2", False), ("res-2", True),
    ]  # fmt: skip


def test_prefill_attempts_are_bounded(tokenizer: Tokenizer) -> None:
    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        with pytest.raises(DownstreamError) as info:
            await _collect(flow, _request(tokenizer))
        assert info.value.grpc_code == "UNAVAILABLE" and "Prefill on w1" in str(info.value)

    def configure(f: Fakes) -> None:
        f.prefill_failures = 5

    fakes = run_with_fakes(tokenizer, configure, body, FlowConfig(prefill_attempts=2))
    assert fakes.assigned == ["res-0", "res-1"] and fakes.decode_calls == 0
    assert sorted(fakes.released) == [("res-0", False), ("res-1", False)]


@pytest.mark.parametrize("dies_after", [0, 1, 2])
def test_a_broken_decode_stream_migrates_without_losing_a_token(
    tokenizer: Tokenizer, dies_after: int
) -> None:
    got: list[RouteChunk] = []

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        got.extend(await _collect(flow, _request(tokenizer), timeout_s=30))

    def configure(f: Fakes) -> None:
        f.decode_dies_after = dies_after

    fakes = run_with_fakes(tokenizer, configure, body)
    tokens = [t for c in got for t in c.token_ids]
    assert tokens == [FIRST, *DECODED]  # none lost, none twice
    assert "".join(c.text for c in got) == tokenizer.decode(tokens)
    assert [c.finish_reason for c in got].count(FinishReason.LENGTH) == 1
    assert got[-1].usage is not None and got[-1].usage.completion_tokens == len(tokens)
    first, moved = fakes.decode_requests
    assert not first.resumed_token_ids and first.kv.HasField("store")
    # The new worker gets the prompt and every token sent so far, and recomputes.
    assert moved.first_token_id == FIRST
    assert list(moved.resumed_token_ids) == DECODED[:dies_after]
    assert list(moved.prompt_token_ids) == list(first.prompt_token_ids)
    assert moved.kv.HasField("recompute") and "w0" in moved.kv.recompute.reason
    assert moved.sampling.max_tokens == first.sampling.max_tokens
    placement = fakes.assign_requests[-1]
    assert placement.decode_only and list(placement.exclude) == ["w0"]
    assert moved.reservation_id == "res-1"
    assert sorted(fakes.released) == [("res-0", False), ("res-0", True), ("res-1", False)]


def test_migrations_are_bounded(tokenizer: Tokenizer) -> None:
    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        with pytest.raises(DownstreamError) as info:
            await _collect(flow, _request(tokenizer))
        assert "Decode (migrated) on w1" in str(info.value)

    def configure(f: Fakes) -> None:
        f.decode_error = grpc.StatusCode.UNAVAILABLE

    fakes = run_with_fakes(tokenizer, configure, body, FlowConfig(migration_limit=1))
    assert fakes.decode_calls == 2
    assert ("res-0", False) in fakes.released and ("res-1", False) in fakes.released


def test_hand_backs_do_not_use_up_the_migrations(tokenizer: Tokenizer) -> None:
    """Workers leaving decode duty hand a stream back twice; with one migration allowed it
    still completes, token for token: a hand-back is no failure. Past
    ``HANDBACK_LIMIT`` it fails."""
    got: list[RouteChunk] = []

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        got.extend(await _collect(flow, _request(tokenizer), timeout_s=30))

    def configure(f: Fakes) -> None:
        f.decode_handbacks = 2

    fakes = run_with_fakes(tokenizer, configure, body, FlowConfig(migration_limit=1))
    assert [t for c in got for t in c.token_ids] == [FIRST, *DECODED]
    assert [list(r.resumed_token_ids) for r in fakes.decode_requests] == [
        [], DECODED[:1], DECODED[:2]
    ]  # fmt: skip

    async def bounced(flow: RequestFlow, fakes: Fakes) -> None:
        with pytest.raises(DownstreamError, match="handed back"):
            await _collect(flow, _request(tokenizer), timeout_s=30)

    def forever(f: Fakes) -> None:
        f.decode_tokens = list(range(10, 10 + 3 * HANDBACK_LIMIT))
        f.decode_handbacks = HANDBACK_LIMIT + 1

    fakes = run_with_fakes(tokenizer, forever, bounced)
    assert fakes.decode_calls == HANDBACK_LIMIT + 1


def test_a_refusal_is_not_retried(tokenizer: Tokenizer) -> None:
    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        with pytest.raises(DownstreamError) as info:
            await _collect(flow, _request(tokenizer))
        assert info.value.grpc_code == "INVALID_ARGUMENT"

    def configure(f: Fakes) -> None:
        f.decode_error = grpc.StatusCode.INVALID_ARGUMENT

    fakes = run_with_fakes(tokenizer, configure, body)
    assert fakes.decode_calls == 1 and fakes.assigned == ["res-0"]


def test_a_worker_refusing_a_sampling_field_names_it_to_the_caller(tokenizer: Tokenizer) -> None:
    """Only the worker's grammar library can tell that a guide does not compile: its refusal
    reaches the caller as INVALID_ARGUMENT naming the request's field, once (no retry)."""
    why = "sampling.guided_regex: Regex parsing error at position 3: Unclosed '['"

    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        with pytest.raises(InvalidArgumentError) as info:
            await _collect(flow, _request(tokenizer))
        assert info.value.field == "sampling.guided_regex"
        assert str(info.value).startswith(f"{why} (refused by Prefill")

    def configure(f: Fakes) -> None:
        f.prefill_refusal = (grpc.StatusCode.INVALID_ARGUMENT, why)

    fakes = run_with_fakes(tokenizer, configure, body)
    assert fakes.assigned == ["res-0"] and fakes.decode_calls == 0
    assert fakes.released == [("res-0", False)]


def test_bounds_are_checked() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        FlowConfig(prefill_attempts=0)
    assert info.value.field == "prefill_attempts"
    with pytest.raises(InvalidArgumentError) as info:
        FlowConfig(migration_limit=-1)
    assert info.value.field == "migration_limit"


def test_a_release_that_meets_a_restarting_scheduler_is_tried_again(tokenizer: Tokenizer) -> None:
    async def body(flow: RequestFlow, fakes: Fakes) -> None:
        await _collect(flow, _request(tokenizer))

    def configure(f: Fakes) -> None:
        f.release_failures = 2

    fakes = run_with_fakes(tokenizer, configure, body)
    assert ("res-0", False) in fakes.released and fakes.release_failures == 0
