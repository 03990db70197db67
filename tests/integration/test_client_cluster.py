"""The SDK against a real cluster (simulated accelerators: real router, scheduler, KV store,
workers and Redis, modelled step times): oversize prompts and streams left early.

* A prompt over the router's limits, by a little or by a hundred times, is ``InvalidRequest``
  naming the field and the limit; one over even the router's receive bound (which gRPC refuses
  unparsed, RESOURCE_EXHAUSTED) is ``RequestTooLarge``, never ``Overloaded``.
* Leaving a ``for``/``async for`` loop over a stream with ``break`` (once a worker's heartbeat
  says it is generating) while the stream object is still referenced cancels the request: the
  worker stops generating, and frees the request's blocks and reservation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from pdserve.client import (
    AsyncClient,
    Client,
    InvalidRequest,
    Overloaded,
    RequestTooLarge,
    RetryPolicy,
)
from pdserve.launcher import Cluster, read_heartbeats
from pdserve.models.demo import init_checkpoint
from pdserve.router import RequestLimits
from tests.integration.failover_load import until

pytestmark = pytest.mark.integration

MAX_LEN = 4096
LIMITS = RequestLimits.for_model(MAX_LEN)
"""The router's limits: its flags' defaults for a model of MAX_LEN tokens."""
LONG = MAX_LEN - 8
"""Tokens of a stream left after two: at the modelled step time (~7 ms on an H100, slowed
three times) it would run for over a minute, far past the deadline of the idle check."""
IDLE_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model_dir = init_checkpoint(
        tmp_path_factory.mktemp("sdk_model"), "tiny", dtype="float32",
        max_position_embeddings=MAX_LEN,
    )  # fmt: skip
    with Cluster(
        model_dir, backend="sim", num_prefill=1, num_decode=1, log_level="WARNING",
        worker_args=("--sim-profile", "roofline:h100:llama-3-8b", "--sim-time-scale", "3",
                     "--heartbeat-interval-s", "0.2"),
    ) as c:  # fmt: skip
        yield c


def generating(cluster: Cluster) -> bool:
    """A worker's heartbeat says it is generating (heartbeats lag a stream's first tokens)."""
    beats = read_heartbeats(cluster.redis_url or "", cluster.namespace)
    return any(w.running_seqs for w in beats)


def idle(cluster: Cluster) -> bool:
    """The workers' heartbeats say nothing runs, is reserved or holds a block."""
    beats = read_heartbeats(cluster.redis_url or "", cluster.namespace)
    return all(
        not w.running_seqs and not w.reservations and w.kv_blocks_free == w.kv_blocks_total
        for w in beats
    )


def wait_idle(cluster: Cluster) -> None:
    asyncio.run(until(lambda: idle(cluster), "the workers to stop generating", IDLE_TIMEOUT_S))


# -- oversize prompts --------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True])
def test_a_prompt_over_its_limit_is_invalid_argument_naming_field_and_limit(
    cluster: Cluster, streaming: bool
) -> None:
    sixty_thousand_words = "lorem " * 60_000
    many_ids = [5] * 200_000
    cases = [
        (sixty_thousand_words, "text", f"this router takes {LIMITS.max_prompt_bytes} at most"),
        (many_ids, "token_ids", f"this router takes {LIMITS.max_prompt_tokens} at most"),
    ]
    with Client(cluster.router_address) as client:
        for prompt, field, limit in cases:
            with pytest.raises(InvalidRequest) as info:
                if streaming:
                    list(client.stream(prompt))
                else:
                    client.generate(prompt)
            assert not isinstance(info.value, RequestTooLarge)
            assert info.value.field == field and limit in info.value.message


def test_a_message_over_the_receive_bound_is_request_too_large_not_overloaded(
    cluster: Cluster,
) -> None:
    huge = "x" * (LIMITS.receive_bytes() + 1)
    retry = RetryPolicy(max_attempts=5, initial_backoff_s=0.001, max_backoff_s=0.002)
    with Client(cluster.router_address, retry=retry) as client:
        for call in (client.generate, lambda p: list(client.stream(p))):
            with pytest.raises(RequestTooLarge) as info:
                call(huge)
            assert isinstance(info.value, InvalidRequest)
            assert not isinstance(info.value, Overloaded)
            assert info.value.field == "prompt"
            assert f"the router takes {LIMITS.receive_bytes()} at most" in info.value.message
        done = client.generate([5, 6, 7], max_tokens=2, ignore_eos=True)  # serving on
    assert len(done.token_ids) == 2


# -- streams left early ------------------------------------------------------------------------


def test_break_out_of_a_sync_stream_stops_the_worker(cluster: Cluster) -> None:
    wait_idle(cluster)
    with Client(cluster.router_address, timeout=300) as client:
        stream = client.stream([5, 6, 7], max_tokens=LONG, ignore_eos=True)
        received = []
        for delta in stream:
            received.extend(delta.token_ids)
            if len(received) >= 2 and generating(cluster):
                break
        wait_idle(cluster)  # while the stream object is still referenced
        assert len(stream.completion().token_ids) < LONG


def test_break_out_of_an_async_stream_stops_the_worker(cluster: Cluster) -> None:
    wait_idle(cluster)

    async def body() -> None:
        async with AsyncClient(cluster.router_address, timeout=300) as client:
            stream = client.stream([5, 6, 7], max_tokens=LONG, ignore_eos=True)
            received: list[int] = []
            async for delta in stream:
                received.extend(delta.token_ids)
                if len(received) >= 2 and await asyncio.to_thread(generating, cluster):
                    break
            # The stream object is still referenced, and never closed.
            await until(lambda: idle(cluster), "the workers to stop generating", IDLE_TIMEOUT_S)
            assert len(stream.completion().token_ids) < LONG

    asyncio.run(body())
