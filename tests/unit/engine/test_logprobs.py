"""Top logprobs and prompt logprobs against HF transformers on the same checkpoint (float32).

Every value is ``log_softmax`` of HF's logits at that position, to 1e-4: the alternatives of
each generated token (greedy and seeded, batched beside requests that ask for other ``k`` or
none), and the logprob, rank and alternatives of each prompt token, with the prompt chunked
over several steps and sent twice (the second time its prefix is cached: prompt logprobs must
still come from computed logits, not be skipped).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.engine import Engine
from pdserve.engine.outputs import GenerationResult
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.logprobs import MAX_LOGPROBS, PromptLogprobs, TopLogprobs
from tests.unit.engine.hf_reference import HFReference

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path) -> HFReference:
    return HFReference(tiny_llama_dir)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    # 32-token steps: a 70-token prompt is prefilled in three chunks.
    return Engine.from_pretrained(
        tiny_llama_dir, dtype="float32", max_num_batched_tokens=32, max_num_seqs=4
    )


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2048, (length,), generator=g).tolist()


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[GenerationResult]:
    results = engine.generate([p for p, _ in requests], [s for _, s in requests])
    engine.check_no_leaks()
    return results


def check_top(top: TopLogprobs, reference: torch.Tensor, k: int) -> None:
    """``top`` is the ``k`` most likely tokens of ``reference`` (``[V]`` log-probabilities)."""
    values, ids = torch.topk(reference, k)
    assert list(top.token_ids) == ids.tolist()
    assert list(top.logprobs) == pytest.approx(values.tolist(), abs=ATOL)


def test_top_logprobs_of_generated_tokens_match_hf(engine: Engine, hf: HFReference) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=20)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [prompt(9, 1), prompt(14, 2), prompt(5, 3)]
    results = run(engine, [(prompts[0], greedy), (prompts[1], seeded), (prompts[2], plain)])
    for p, params, result in zip(prompts, (greedy, seeded), results, strict=False):
        ids = p + result.token_ids
        reference = torch.log_softmax(hf.logits(ids), dim=-1)[len(p) - 1 : -1]  # [6, V]
        assert len(result.top_logprobs) == 6
        for step, top in enumerate(result.top_logprobs):
            check_top(top, reference[step], params.logprobs)
            # the sampled token's own logprob is the same distribution's
            assert result.logprobs[step] == pytest.approx(
                float(reference[step, result.token_ids[step]]), abs=ATOL
            )
    assert results[2].top_logprobs == []  # asked for none: none computed


def check_prompt(pl: PromptLogprobs | None, p: list[int], hf: HFReference, k: int) -> None:
    assert pl is not None and pl.token_ids == p
    reference = torch.log_softmax(hf.logits(p), dim=-1)[:-1]  # position i predicts p[i + 1]
    target = torch.tensor(p[1:])
    chosen = reference.gather(1, target.unsqueeze(1)).squeeze(1)
    assert pl.logprobs == pytest.approx(chosen.tolist(), abs=ATOL)
    assert pl.ranks == ((reference > chosen.unsqueeze(1)).sum(dim=1) + 1).tolist()
    assert len(pl.top) == (len(p) - 1 if k else 0)
    for i, top in enumerate(pl.top):
        check_top(top, reference[i], k)


def test_prompt_logprobs_match_hf_chunked_and_cached(engine: Engine, hf: HFReference) -> None:
    long, short = prompt(70, 4), prompt(12, 5)
    with_top = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    bare = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    first = run(engine, [(long, with_top), (short, bare), (prompt(20, 6), SamplingParams())])
    check_prompt(first[0].prompt_logprobs, long, hf, 3)
    check_prompt(first[1].prompt_logprobs, short, hf, 0)
    assert first[2].prompt_logprobs is None
    # Again: the long prompt's blocks are in the prefix cache now, which must not shorten it.
    queries = engine.block_manager.prefix_queries
    again = run(engine, [(long, with_top)])
    check_prompt(again[0].prompt_logprobs, long, hf, 3)
    assert again[0].token_ids == first[0].token_ids
    assert engine.block_manager.prefix_queries == queries  # not even looked up
    # Without prompt logprobs the same prompt is served from the cache, as before.
    cached = run(engine, [(long, SamplingParams(temperature=0, max_tokens=2))])
    assert engine.block_manager.prefix_queries > queries and cached[0].num_cached_tokens > 0


def test_an_imported_request_computes_no_prompt_logprobs(engine: Engine) -> None:
    p = prompt(10, 7)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1)
    engine.add_request("held", p, params.first_token_only(), hold_kv=True)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (first,) = outs
    assert first.prompt_logprobs is not None and len(first.new_top_logprobs) == 1
    payload = engine.export_kv("held")
    engine.release_kv("held")
    engine.add_request(
        "decoded", p, params, kv=payload,
        first_token=(first.new_token_ids[0], first.new_logprobs[0]),
    )  # fmt: skip
    rest = []
    while engine.has_unfinished():
        rest += engine.step()
    assert all(o.prompt_logprobs is None for o in rest)
    assert sum(len(o.new_top_logprobs) for o in rest) == 2  # the decode side's tokens
    engine.check_no_leaks()


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, True, 1.5])
def test_out_of_range_counts_are_refused_by_name(name: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        SamplingParams(**{name: value})  # type: ignore[arg-type]
    assert err.value.field == name
