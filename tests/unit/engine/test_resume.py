"""A request resumed with the output tokens another engine drew (a migration) continues exactly
as the undisturbed run: greedy and seeded sampling, max_tokens, stop strings, no leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.outputs import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from tests.unit.engine.test_parity import prompts_of


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=8)


def resumed_run(
    engine: Engine, prompt: list[int], params: SamplingParams, generated: list[int]
) -> tuple[list[int], FinishReason | None, int]:
    """The tokens after ``generated``, the finish reason, and the number of outputs seen."""
    engine.add_request("resumed", prompt, params, generated=generated)
    tokens: list[int] = []
    finish = None
    outputs = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs += 1
            tokens += out.new_token_ids
            if out.finished:
                finish = out.finish_reason
    return tokens, finish, outputs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=1.1, top_k=40, seed=77, max_tokens=14, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("cut", [1, 5, 13])
def test_resumed_request_continues_the_undisturbed_run(
    engine: Engine, params: SamplingParams, cut: int
) -> None:
    prompt = prompts_of(engine, [19])[0]
    whole = engine.generate(prompt, params)[0]
    assert len(whole.token_ids) == params.max_tokens
    rest, finish, _ = resumed_run(engine, prompt, params, whole.token_ids[:cut])
    assert rest == whole.token_ids[cut:]  # max_tokens counts the resumed tokens too
    assert finish is FinishReason.LENGTH
    engine.check_no_leaks()


def test_a_stop_string_across_the_move_is_caught(engine: Engine) -> None:
    prompt = prompts_of(engine, [11])[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    whole = engine.generate(prompt, greedy)[0].token_ids
    # A stop string made of the end of token 3's text and the start of token 4's.
    before, after = engine.tokenizer.decode(whole[:4]), engine.tokenizer.decode(whole[:5])
    stop = after[len(before) - 1 : len(before) + 1]
    if len(stop) < 2 or stop in before:
        pytest.skip("these tokens give no stop string spanning the boundary")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,))
    rest, finish, _ = resumed_run(engine, prompt, params, whole[:4])
    assert rest == [whole[4]] and finish is FinishReason.STOP
    engine.check_no_leaks()


def test_a_request_that_already_ended_is_refused(engine: Engine) -> None:
    prompt = prompts_of(engine, [7])[0]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    whole = engine.generate(prompt, params)[0].token_ids
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_request("done", prompt, params, generated=whole)
    assert info.value.field == "generated"
    stop_at = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=(whole[1],)
    )
    with pytest.raises(InvalidArgumentError):
        engine.add_request("stopped", prompt, stop_at, generated=whole[:2])
    with pytest.raises(InvalidArgumentError):
        engine.add_request("bad", prompt, params, generated=[10**6])
    engine.check_no_leaks()
