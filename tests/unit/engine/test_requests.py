"""Sampling reproducibility, stop conditions, abort, bad input, and randomized leak checks."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.outputs import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import CapacityError, DuplicateRequestError, InvalidArgumentError
from tests.unit.engine.test_parity import prompts_of


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8)


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    prompt = prompts_of(engine, [12])[0]
    p = SamplingParams(
        temperature=1.3, top_k=50, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True
    )
    a = engine.generate(prompt, p)[0].token_ids
    # Same seed in a different batch composition: same tokens.
    others = prompts_of(engine, [5, 30], seed=9)
    b = engine.generate(
        [others[0], prompt, others[1]], [p.__class__(temperature=0.7, max_tokens=5), p, p]
    )[1].token_ids
    c = engine.generate(
        prompt,
        SamplingParams(
            temperature=1.3, top_k=50, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True
        ),
    )[0].token_ids
    assert a == b
    assert a != c
    assert len(set(a)) > 5
    engine.check_no_leaks()


def test_top_k_one_is_greedy(engine: Engine) -> None:
    prompt = prompts_of(engine, [9])[0]
    greedy = engine.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )[0]
    topk = engine.generate(
        prompt, SamplingParams(temperature=5.0, top_k=1, max_tokens=8, ignore_eos=True)
    )[0]
    assert greedy.token_ids == topk.token_ids
    assert all(lp <= 0 and math.isfinite(lp) for lp in greedy.logprobs)


def test_stop_token_and_stop_string(engine: Engine) -> None:
    prompt = prompts_of(engine, [10], seed=3)[0]
    free = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[
        0
    ]
    assert free.finish_reason == FinishReason.LENGTH and len(free.token_ids) == 16
    # Stop token: the 5th generated token.
    stop_tok = free.token_ids[4]
    first_at = free.token_ids.index(stop_tok)
    r = engine.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(stop_tok,), ignore_eos=True),
    )[0]
    assert r.finish_reason == FinishReason.STOP and r.token_ids == free.token_ids[: first_at + 1]
    # Stop string: a piece of the free-running text past its start.
    text = free.text
    assert len(text) > 8
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    s = engine.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=16, stop=(needle,), ignore_eos=True)
    )[0]
    assert s.finish_reason == FinishReason.STOP
    assert s.text == text[: text.find(needle)]
    assert needle not in s.text
    engine.check_no_leaks()


def test_abort_mid_sequence_frees_blocks(engine: Engine) -> None:
    prompts = prompts_of(engine, [30, 8])
    p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", prompts[0], p)
    engine.add_request("b", prompts[1], p)
    got = 0
    while got < 3:
        got += sum(1 for o in engine.step() if o.request_id == "a")
    assert engine.abort("a")
    assert not engine.abort("a")
    while engine.has_unfinished():
        assert all(o.request_id == "b" for o in engine.step())
    engine.check_no_leaks()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_bad_sampling_params(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert e.value.field == field


def test_bad_requests(engine: Engine) -> None:
    ok = SamplingParams(max_tokens=4)
    cases: list[tuple[object, SamplingParams, str]] = [
        ("", ok, "prompt"),
        ([], ok, "prompt_token_ids"),
        ([1, engine.model_config.vocab_size], ok, "prompt_token_ids"),
        ([-1], ok, "prompt_token_ids"),
        ([1] * engine.max_model_len, ok, "prompt"),
        ([1, 2], SamplingParams(max_tokens=engine.max_model_len), "max_tokens"),
        (
            [1, 2],
            SamplingParams(stop_token_ids=(engine.model_config.vocab_size + 5,)),
            "stop_token_ids",
        ),
    ]
    for prompt, params, field in cases:
        with pytest.raises(InvalidArgumentError) as e:
            engine.add_request("bad", prompt, params)  # type: ignore[arg-type]
        assert e.value.field == field, (prompt, params)
    engine.add_request("dup", [1, 2, 3], ok)
    with pytest.raises(DuplicateRequestError):
        engine.add_request("dup", [1, 2, 3], ok)
    engine.abort("dup")
    with pytest.raises(CapacityError):  # more KV than the whole pool
        engine.add_request("huge", [1] * 100, SamplingParams(max_tokens=500))
    engine.check_no_leaks()


def test_randomized_add_step_abort_leaks_nothing(tiny_llama_dir: Path) -> None:
    """Thousands of random operations under a tiny pool; every block comes back."""
    eng = Engine.from_pretrained(
        tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=24,
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=6,
    )
    rnd = random.Random(7)
    live: set[str] = set()
    held: set[str] = set()
    n_ops = 3000
    for op in range(n_ops):
        r = rnd.random()
        if r < 0.25:
            rid = f"q{op}"
            prompt = [
                rnd.randrange(3, eng.model_config.vocab_size) for _ in range(rnd.randint(1, 30))
            ]
            params = SamplingParams(
                temperature=rnd.choice([0.0, 1.0]), max_tokens=rnd.randint(1, 20), seed=op
            )
            hold = rnd.random() < 0.2
            eng.add_request(rid, prompt, params, hold_kv=hold, tenant=rnd.choice(["", "t1"]))
            live.add(rid)
        elif r < 0.35 and (live or held):
            rid = rnd.choice(sorted(live | held))
            assert eng.abort(rid)
            live.discard(rid)
            held.discard(rid)
        elif r < 0.40 and held:
            rid = rnd.choice(sorted(held))
            payload = eng.export_kv(rid)
            assert payload.num_tokens > 0
            eng.release_kv(rid)
            held.discard(rid)
        else:
            for o in eng.step():
                if o.finished:
                    live.discard(o.request_id)
                    if o.request_id in eng._held:
                        held.add(o.request_id)
        eng.block_manager.check_consistency([*eng.scheduler.running, *eng._held.values()])
    for rid in list(live | held):
        eng.abort(rid)
    eng.check_no_leaks()
    assert eng.stats().num_preemptions > 0
