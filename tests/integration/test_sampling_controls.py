"""vLLM's logits controls over gRPC through a real disaggregated cluster (router, scheduler, KV
store, one prefill and one decode worker as processes): the prefill worker draws the first
token and the decode worker the rest, so each control must reach both through the protos.

Each request is compared token for token with the in-process engine given the same
parameters; the defining promises are checked outright (a +100 bias forces its token,
``min_tokens`` holds back a stop token that would end the request at once); bad values are
INVALID_ARGUMENT naming the GenerateRequest field.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.client import Client, InvalidRequest
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import Cluster

pytestmark = pytest.mark.integration

WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "256")
PROMPT = "the quick brown fox jumps over the lazy dog and the cat"


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir  # the session's tiny checkpoint (float32, seed 0)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine.from_pretrained(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[Cluster]:
    with Cluster(model_dir, num_prefill=1, num_decode=1, worker_args=WORKER_ARGS) as c:
        yield c


def alone(engine: Engine, prompt: str | list[int] = PROMPT, **options: Any) -> list[int]:
    """The tokens of the engine alone, in this process."""
    return engine.generate([prompt], SamplingParams(**options))[0].token_ids


def test_controls_are_honoured_across_the_hand_off(cluster: Cluster, engine: Engine) -> None:
    plain = alone(engine, temperature=0.0, max_tokens=8)
    forced, stop = plain[3], plain[0]
    with Client(cluster.router_address, timeout=60) as client:
        # A bias of +100 forces its token, greedy or not.
        for temperature in (0.0, 0.8):
            done = client.generate(
                PROMPT, max_tokens=6, temperature=temperature, seed=1, logit_bias={forced: 100}
            )
            assert done.token_ids == [forced] * 6
        # A stop token that would end the request at once is held back by min_tokens.
        once = client.generate(PROMPT, max_tokens=8, temperature=0, stop_token_ids=[stop])
        assert once.token_ids == [stop] and once.finish_reason == "stop"
        deltas = list(
            client.stream(PROMPT, max_tokens=8, temperature=0, stop_token_ids=[stop], min_tokens=5)
        )
        held = [t for d in deltas for t in d.token_ids]
        assert len(held) >= 5 and stop not in held[:5]
        assert held == alone(
            engine, temperature=0.0, max_tokens=8, stop_token_ids=(stop,), min_tokens=5
        )
        # Every other control, and all of them at once: the engine alone's tokens. The prompt
        # holds many of the tokens the model likes, so that the repetition penalty matters.
        rng = random.Random(5)
        ids = [rng.randrange(4, 2048) for _ in range(150)]
        base = alone(engine, temperature=0.0, max_tokens=10, prompt=ids)
        words = [engine.tokenizer.decode(base[:1]).strip(), engine.tokenizer.decode(base[2:4])]
        for options in [
            {"repetition_penalty": 1.4},
            {"presence_penalty": -2.0, "frequency_penalty": -2.0},  # repeats the output
            {"allowed_token_ids": [base[5], base[6], 9]},
            {"bad_words_token_ids": [[base[0]], [base[2], base[3]]]},
            {"bad_words": words},  # tokenized by the router
            {"temperature": 1.0, "seed": 7, "min_p": 0.2},
            {
                "temperature": 0.9, "seed": 3, "min_p": 0.05, "repetition_penalty": 1.2,
                "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {9: 3.0},
                "bad_words": words, "min_tokens": 4,
            },
        ]:  # fmt: skip
            options = {"temperature": 0.0, "max_tokens": 10, **options}
            got = client.generate(ids, **options)
            domain = {
                k: tuple(map(tuple, v)) if k == "bad_words_token_ids" else v
                for k, v in options.items()
            }
            want = alone(engine, prompt=ids, **domain)
            assert got.token_ids == want, options
            assert want != base, f"{options} was meant to change the output"


BAD: list[tuple[dict[str, object], str]] = [
    ({"presence_penalty": 2.5}, "sampling.presence_penalty"),
    ({"frequency_penalty": -3}, "sampling.frequency_penalty"),
    ({"repetition_penalty": 0}, "sampling.repetition_penalty"),
    ({"min_p": 1.5}, "sampling.min_p"),
    ({"min_tokens": 9, "max_tokens": 8}, "sampling.min_tokens"),
    ({"logit_bias": {5: 100.5}}, "sampling.logit_bias"),
    ({"logit_bias": {2048: 1.0}}, "sampling.logit_bias"),  # id == vocab size
    ({"allowed_token_ids": [5, 2048]}, "sampling.allowed_token_ids"),
    ({"allowed_token_ids": [5], "bad_words_token_ids": [[5]]}, "sampling.allowed_token_ids"),
    ({"bad_words_token_ids": [[1, 2048]]}, "sampling.bad_words_token_ids"),
    ({"bad_words_token_ids": [[]]}, "sampling.bad_words_token_ids"),
    ({"bad_words": [" "]}, "sampling.bad_words"),
    # The router's limits on their sizes (its defaults).
    ({"logit_bias": {t: 1.0 for t in range(1025)}}, "sampling.logit_bias"),
    ({"bad_words": ["w"] * 129}, "sampling.bad_words"),
    ({"bad_words": ["w" * 4097]}, "sampling.bad_words"),
]


@pytest.mark.parametrize(("options", "field"), BAD)
def test_bad_values_are_invalid_argument_naming_the_field(
    cluster: Cluster, options: dict[str, object], field: str
) -> None:
    with Client(cluster.router_address, timeout=30) as client:
        for call in (client.generate, lambda *a, **kw: list(client.stream(*a, **kw))):
            with pytest.raises(InvalidRequest) as info:
                call(PROMPT, **options)
            assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.field == field, info.value.message
