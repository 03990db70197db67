"""Structured output over gRPC through a real disaggregated cluster (router, scheduler, KV
store, one prefill and one decode worker as processes): the prefill worker draws the first
token under the grammar, the decode worker rebuilds the matcher from the request's guide,
replays that token and continues. Each output is compared token for token with the
in-process engine given the same seeded parameters (so the decode side continued exactly
where the grammar was), and checked against its schema, regex or choices; a guide that does
not compile, or breaks a rule, is INVALID_ARGUMENT naming the GenerateRequest field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from pdserve.client import Client, InvalidRequest
from pdserve.engine.engine import Engine
from pdserve.engine.guide import Guide
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import Cluster
from tests.unit.engine.test_guided import CHOICES, GRAMMAR, GRAMMAR_TEXT, REGEX, SCHEMA

pytestmark = pytest.mark.integration

WORKER_ARGS = ("--dtype", "float32", "--threads", "1", "--kv-blocks", "256")
PROMPT = "tell me about a person"


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


def alone(engine: Engine, guide: Guide, **options: Any) -> list[int]:
    """The tokens of the engine alone, in this process."""
    return engine.generate([PROMPT], SamplingParams(guide=guide, **options))[0].token_ids


def test_guided_outputs_continue_across_the_hand_off(cluster: Cluster, engine: Engine) -> None:
    cases: list[tuple[dict[str, Any], Guide, Any]] = [
        ({"guided_json": SCHEMA}, Guide.json_schema(SCHEMA), None),
        ({"guided_regex": REGEX}, Guide.regex(REGEX), lambda t: re.fullmatch(REGEX, t)),
        ({"guided_choice": list(CHOICES)}, Guide.choice(CHOICES), lambda t: t in CHOICES),
        ({"guided_grammar": GRAMMAR}, Guide.grammar(GRAMMAR), GRAMMAR_TEXT.fullmatch),
    ]
    with Client(cluster.router_address, timeout=120) as client:
        for keywords, guide, matches in cases:
            for seed in range(6):
                options = {"temperature": 1.0, "seed": seed, "max_tokens": 400}
                streamed = seed % 2 == 1
                if streamed:
                    deltas = list(client.stream(PROMPT, **keywords, **options))
                    tokens = [t for d in deltas for t in d.token_ids]
                    text = "".join(d.text for d in deltas)
                    finish = deltas[-1].finish_reason
                else:
                    done = client.generate(PROMPT, **keywords, **options)
                    tokens, text, finish = done.token_ids, done.text, done.finish_reason
                assert finish == "stop", (keywords, text)
                assert tokens == alone(engine, guide, **options), (keywords, seed)
                if matches is None:
                    jsonschema.validate(json.loads(text), SCHEMA)
                else:
                    assert matches(text), (keywords, text)
        # OpenAI's json_object: any object (unbounded, so the random model may not finish one).
        options = {"temperature": 1.0, "seed": 4, "max_tokens": 256}
        done = client.generate("{", guided_json_object=True, **options)
        params = SamplingParams(guide=Guide.json_object(), **options)
        assert done.token_ids == engine.generate(["{"], params)[0].token_ids
        assert done.finish_reason != "stop" or isinstance(json.loads(done.text), dict)


BAD: list[tuple[dict[str, object], str]] = [
    # Refused by the router (no grammar library there): the request's own rules.
    ({"guided_json": "{not json"}, "sampling.guided_json"),
    ({"guided_json": "[1, 2]"}, "sampling.guided_json"),
    ({"guided_choice": ["yes", ""]}, "sampling.guided_choice"),
    ({"guided_json": "{}", "guided_regex": "a"}, "sampling.guided_regex"),  # refused by the SDK
    ({"guided_grammar": "x" * 40000}, "sampling.guided_grammar"),  # --max-guide-chars
    ({"guided_json": '{"items": ' * 129 + "{}" + "}" * 129}, "sampling.guided_json"),  # depth
    # Refused by the prefill worker's compile, passed through by the router.
    ({"guided_regex": "(["}, "sampling.guided_regex"),
    ({"guided_regex": r"(a)\1"}, "sampling.guided_regex"),
    ({"guided_grammar": 'root ::= "a" |'}, "sampling.guided_grammar"),
    ({"guided_json": {"type": "nonsense"}}, "sampling.guided_json"),
    # Crashes xgrammar's compiler: its probe process takes the crash, not the worker.
    ({"guided_grammar": "root ::= root {2}"}, "sampling.guided_grammar"),
]


@pytest.mark.parametrize(("options", "field"), BAD)
def test_bad_guides_are_invalid_argument_naming_the_field(
    cluster: Cluster, options: dict[str, object], field: str
) -> None:
    with Client(cluster.router_address, timeout=30) as client:
        for call in (client.generate, lambda *a, **kw: list(client.stream(*a, **kw))):
            with pytest.raises(InvalidRequest) as info:
                call(PROMPT, max_tokens=8, **options)
            assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.field == field, info.value.message
        # The cluster serves on: nothing of the refused requests was left behind.
        assert client.generate(PROMPT, max_tokens=2, guided_choice=["ok"]).text == "ok"
