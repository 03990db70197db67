"""The SDK against a real cluster (simulated accelerators: real router, scheduler, KV store,
workers and Redis, modelled step times).

A prompt over the router's limits, by a little or by a hundred times, is ``InvalidRequest``
naming the field and the limit; one over even the router's receive bound (which gRPC refuses
unparsed, RESOURCE_EXHAUSTED) is ``RequestTooLarge``, never ``Overloaded``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.client import (
    Client,
    InvalidRequest,
    Overloaded,
    RequestTooLarge,
    RetryPolicy,
)
from pdserve.launcher import Cluster
from pdserve.models.demo import init_checkpoint
from pdserve.router import RequestLimits

pytestmark = pytest.mark.integration

MAX_LEN = 4096
LIMITS = RequestLimits.for_model(MAX_LEN)
"""The router's limits: its flags' defaults for a model of MAX_LEN tokens."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model_dir = init_checkpoint(
        tmp_path_factory.mktemp("sdk_model"), "tiny", dtype="float32",
        max_position_embeddings=MAX_LEN,
    )  # fmt: skip
    with Cluster(
        model_dir, backend="sim", num_prefill=1, num_decode=1, log_level="WARNING",
        worker_args=("--sim-profile", "roofline:h100:llama-3-8b"),
    ) as c:  # fmt: skip
        yield c


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
