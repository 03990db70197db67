"""Structured output in the backend contract (conftest ``backend_kind``: torch, tensorrt-llm on
the stand-in, sim): a guided request's output is in its grammar whole, across the backend's own
hand-off (the prefill draws the first token under the grammar, the decode side continues it),
after a recompute and after a migration, or the backend refuses that path naming the field; a
guide that does not compile is refused naming its field before the request runs."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest

from pdserve.backends import TENSORRT_LLM
from pdserve.engine.guide import Guide
from pdserve.engine.outputs import FinishReason
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.tokenizer import Tokenizer
from tests.unit.backends.conftest import open_backend, run
from tests.unit.backends.test_contract import barrier, collect, handed_over, handoff_of, prompts
from tests.unit.engine.test_guided import REGEX, SCHEMA

pytest.importorskip("xgrammar")


def sampled(guide: Guide, seed: int, max_tokens: int = 400) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, guide=guide)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


def test_a_guided_output_holds_on_every_path(
    backend_kind: str, tiny_llama_dir: Path, tokenizer: Tokenizer
) -> None:
    p = prompts(11, [9])[0]
    guide = Guide.json_schema(SCHEMA)

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            trt = backend.name == TENSORRT_LLM
            for seed in range(3):
                params = sampled(guide, seed)
                whole, _, outs = await collect(
                    backend.generate(EngineRequest(f"w{seed}", p, params))
                )
                assert outs[-1].finish_reason is FinishReason.STOP
                assert whole[-1] in tokenizer.eos_token_ids  # where the grammar is complete
                jsonschema.validate(json.loads(tokenizer.decode(whole)), SCHEMA)
                # The backend's own hand-off: the same seeded tokens, so the decode side
                # continued the grammar where the prefill's first token left it.
                rid = f"s{seed}"
                pre = await backend.prefill(
                    EngineRequest(rid, p, params), handoff=handoff_of(backend)
                )
                first = pre.output.new_token_ids[0]
                kv = await handed_over(backend, pre, rid)
                rest, _, outs = await collect(
                    backend.decode(EngineRequest(rid, p, params), (first, 0.0), kv)
                )
                assert [first, *rest] == whole and outs[-1].finish_reason is FinishReason.STOP
                # Tokens drawn elsewhere (recompute, migration) replayed into the grammar.
                if trt:
                    for stream in (
                        backend.decode(EngineRequest(f"r{seed}", p, params), (first, 0.0), None),
                        backend.generate(EngineRequest(f"m{seed}", p, params), generated=whole[:5]),
                    ):
                        with pytest.raises(InvalidArgumentError) as err:
                            await collect(stream)
                        assert err.value.field == "sampling.guided_json"
                    continue
                rest, _, _ = await collect(
                    backend.decode(EngineRequest(f"r{seed}", p, params), (first, 0.0), None)
                )
                assert [first, *rest] == whole
                moved, _, _ = await collect(
                    backend.generate(EngineRequest(f"m{seed}", p, params), generated=whole[:5])
                )
                assert moved == whole[5:]
            for guide_, ok in (
                (Guide.regex(REGEX), lambda t: re.fullmatch(REGEX, t)),
                (Guide.choice(["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
            ):
                tokens, _, outs = await collect(
                    backend.generate(EngineRequest("g", p, sampled(guide_, 1, 32)))
                )
                assert outs[-1].finish_reason is FinishReason.STOP
                assert ok(tokenizer.decode(tokens)), tokenizer.decode(tokens)
            await barrier(backend)
            assert backend.capacity().running == 0

    run(body, timeout_s=300)


@pytest.mark.parametrize(
    ("guide", "field"),
    [
        (Guide.regex("(["), "sampling.guided_regex"),
        (Guide.grammar('root ::= "a" |'), "sampling.guided_grammar"),
        (Guide.json_schema({"type": "nonsense"}), "sampling.guided_json"),
    ],
)
def test_a_guide_that_does_not_compile_is_refused_by_field(
    backend_kind: str, tiny_llama_dir: Path, guide: Guide, field: str
) -> None:
    p = prompts(12, [6])[0]
    params = sampled(guide, 0, 8)

    async def body() -> None:
        async with open_backend(backend_kind, tiny_llama_dir) as backend:
            for attempt in (
                collect(backend.generate(EngineRequest("g", p, params))),
                backend.prefill(EngineRequest("p", p, params), handoff=handoff_of(backend)),
            ):
                with pytest.raises(InvalidArgumentError) as err:
                    await attempt
                assert err.value.field == field
            await barrier(backend)
            capacity = backend.capacity()
            assert capacity.running == 0 and capacity.waiting == 0

    run(body)


def test_first_token_only_keeps_the_guide() -> None:
    params = sampled(Guide.regex(REGEX), 0)
    assert params.first_token_only().guide == params.guide
    assert dataclasses.replace(params.after(1)).guide == params.guide
