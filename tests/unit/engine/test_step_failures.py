"""A failed step fails only its own requests, on a real engine with injected faults: the
others produce exactly the tokens of an undisturbed run, and no block leaks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.faults import EngineFaults
from pdserve.engine.outputs import RequestOutput, StepFailedError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import RequestFailedError
from tests.unit.engine.test_parity import prompts_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=10, ignore_eos=True)


def load(model_dir: Path, faults: EngineFaults | None = None) -> Engine:
    return Engine.from_pretrained(model_dir, dtype="float32", num_kv_blocks=128, faults=faults)


def run(
    engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> tuple[dict[str, list[int]], dict[str, RequestFailedError]]:
    """Add every request, step to the end; tokens per request and the failures seen."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    failures: dict[str, RequestFailedError] = {}
    while engine.has_unfinished():
        outputs: list[RequestOutput]
        try:
            outputs = engine.step()
        except StepFailedError as err:
            assert not failures.keys() & err.failures.keys()  # each fails once
            failures.update(err.failures)
            outputs = err.outputs
        for out in outputs:
            assert out.request_id not in failures
            tokens[out.request_id] += out.new_token_ids
    return tokens, failures


def test_non_finite_logits_fail_their_request_alone(tiny_llama_dir: Path) -> None:
    prompts = prompts_of(load(tiny_llama_dir), [7, 30, 12, 19], seed=5)
    requests = {
        "a": (prompts[0], GREEDY),
        "bad-greedy": (prompts[1], GREEDY),
        "b": (prompts[2], SAMPLED),
        "bad-sampled": (prompts[3], SAMPLED),
    }
    good = {k: v for k, v in requests.items() if not k.startswith("bad")}
    undisturbed, none = run(load(tiny_llama_dir), good)
    assert none == {}
    engine = load(tiny_llama_dir, EngineFaults(nan_prefix="bad-"))
    tokens, failures = run(engine, requests)
    assert set(failures) == {"bad-greedy", "bad-sampled"}
    assert all("not finite" in str(e) or "sampling failed" in str(e) for e in failures.values())
    assert {k: tokens[k] for k in good} == undisturbed
    assert all(len(t) == GREEDY.max_tokens for t in undisturbed.values())
    engine.check_no_leaks()
    # The engine goes on: the same requests again, without the bad ones.
    assert run(engine, good) == (undisturbed, {})
    engine.check_no_leaks()


def test_a_step_that_raises_fails_its_batch_and_the_engine_goes_on(tiny_llama_dir: Path) -> None:
    engine = load(tiny_llama_dir, EngineFaults(step_prefix="boom"))
    prompts = prompts_of(engine, [9, 40, 5], seed=6)
    undisturbed, _ = run(load(tiny_llama_dir), {"later": (prompts[2], GREEDY)})
    # "x" decodes when "boom" arrives: its next step carries both, and fails both.
    engine.add_request("x", prompts[0], GREEDY)
    first = engine.step()
    assert [o.request_id for o in first] == ["x"]
    engine.add_request("boom", prompts[1], dataclasses.replace(GREEDY, max_tokens=3))
    with pytest.raises(StepFailedError) as info:
        engine.step()
    assert set(info.value.failures) == {"x", "boom"} and info.value.outputs == []
    assert "injected fault" in str(info.value.failures["x"])
    assert not engine.has_unfinished()
    engine.check_no_leaks()
    assert run(engine, {"later": (prompts[2], GREEDY)}) == (undisturbed, {})
    engine.check_no_leaks()


def test_an_import_that_cannot_be_written_fails_alone(tiny_llama_dir: Path) -> None:
    a, b = load(tiny_llama_dir), load(tiny_llama_dir)
    prompts = prompts_of(a, [20, 11], seed=8)
    first_only = dataclasses.replace(GREEDY, max_tokens=1)
    a.add_request("p", prompts[0], first_only, hold_kv=True)
    (out,) = a.step()
    payload = a.export_kv("p")
    a.release_kv("p")
    bad_shape = dataclasses.replace(
        payload, keys=tuple(np.ascontiguousarray(k[:, :, :-1]) for k in payload.keys)
    )
    undisturbed, _ = run(load(tiny_llama_dir), {"c": (prompts[1], GREEDY)})
    b.add_request("d", prompts[0], GREEDY, kv=bad_shape, first_token=(out.new_token_ids[0], 0.0))
    tokens, failures = run(b, {"c": (prompts[1], GREEDY)})
    assert set(failures) == {"d"} and "cannot import" in str(failures["d"])
    assert tokens["c"] == undisturbed["c"]
    b.check_no_leaks()
