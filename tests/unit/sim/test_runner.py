"""The sim engine: pdserve's real engine on a ``SimRunner``.

Its steps take exactly the modelled time (a fake clock counts it), its tokens depend only on
the prompt, the output position and the seed, its stand-in KV goes through the real paged
blocks, prefix cache and imports, and a KV that does not hold the prompt fails the request.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.block_manager import chain_block_hashes
from pdserve.engine.engine import Engine
from pdserve.engine.guide import Guide
from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.engine.outputs import FinishReason, StepFailedError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.sim.backend import SimOptions, sim_compute
from pdserve.sim.fitted import Fitted
from pdserve.sim.runner import SimRunner, prompt_digest, sim_token
from pdserve.sim.shapes import ModelShape
from pdserve.sim.timing import SimStep, step_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def stand_in_payload(layout: KVLayout, prompt_ids: list[int]) -> KVPayload:
    """The payload a sim prefill of ``prompt_ids`` hands over (``SimRunner.read_layer``'s)."""
    n = len(prompt_ids)
    k = np.asarray(prompt_ids, dtype=np.float32).reshape(n, 1, 1)
    v = np.arange(n, dtype=np.float32).reshape(n, 1, 1)
    return KVPayload(layout, n, (k,) * layout.num_layers, (v,) * layout.num_layers)


@dataclass
class Ticks:
    """A fake clock that only ``sleep`` advances, recording each sleep."""

    now: float = 100.0
    slept: list[float] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@dataclass(frozen=True)
class Linear:
    """A timing model of 1 ms a step plus 10 us a prompt token and 100 us a decode."""

    def step_time(self, step: SimStep) -> float:
        if not step.num_tokens:
            return 0.0
        return 1e-3 + 1e-5 * step.prefill_tokens + 1e-4 * step.num_decodes

    def describe(self) -> str:
        return "linear"


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in lengths]


def sim_engine(model_dir: Path, profile: str = "", **config: object) -> Engine:
    """A sim engine on the checkpoint's vocabulary, modelling its own shape unless
    ``profile`` says otherwise."""
    options = SimOptions.parse(profile or f"roofline:h100:{model_dir / 'config.json'}")
    return Engine.from_pretrained(
        model_dir, compute=sim_compute(options), num_kv_blocks=64, **config
    )


def with_runner(engine: Engine, ticks: Ticks, scale: float = 1.0) -> SimRunner:
    """Put a ``Linear`` runner on the fake clock in place of the engine's."""
    old = engine.runner
    assert isinstance(old, SimRunner)
    runner = SimRunner(
        Linear(),
        num_blocks=engine.block_manager.num_blocks,
        block_size=engine.config.block_size,
        num_layers=engine.layout.num_layers,
        vocab_size=engine.model_config.vocab_size,
        avoid=engine.tokenizer.eos_token_ids,
        time_scale=scale,
        sleep=ticks.sleep,
        clock=ticks.clock,
    )
    engine.runner = runner
    return runner


def test_each_step_sleeps_its_modelled_time_stretched_by_the_scale(tiny_llama_dir: Path) -> None:
    engine = sim_engine(tiny_llama_dir)
    ticks = Ticks()
    with_runner(engine, ticks, scale=3.0)
    took = []
    engine.add_request("a", prompts(0, [40])[0], GREEDY)
    took.append(ticks.now)
    engine.step()  # the whole 40-token prompt: 1 ms + 40 * 10 us
    took.append(ticks.now)
    engine.add_request("b", prompts(1, [8])[0], GREEDY)
    engine.step()  # a's first decode and b's prompt
    took.append(ticks.now)
    engine.step()  # two decodes
    took.append(ticks.now)
    steps = [b - a for a, b in itertools.pairwise(took)]
    assert steps == pytest.approx([3 * (1e-3 + 40e-5), 3 * (1e-3 + 8e-5 + 1e-4), 3 * (1e-3 + 2e-4)])
    assert len(ticks.slept) == 4 + 4 + 1  # prefill steps by layer, a decode step at once


def test_tokens_are_a_function_of_prompt_position_and_seed(tiny_llama_dir: Path) -> None:
    ps = prompts(2, [5, 30, 70])
    first = sim_engine(tiny_llama_dir).generate(ps, GREEDY)
    # Another engine, prompts in another order and batched differently: the same streams.
    again = sim_engine(tiny_llama_dir, max_num_seqs=1).generate(ps[::-1], GREEDY)[::-1]
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    eos = set(sim_engine(tiny_llama_dir).tokenizer.eos_token_ids)
    choices = [t for t in range(2048) if t not in eos]
    for p, r in zip(ps, first, strict=True):
        assert len(set(r.token_ids)) > GREEDY.max_tokens // 2  # varied, not one repeated id
        digest = prompt_digest(p)
        want = [choices[sim_token(digest, i, 0, len(choices))] for i in range(GREEDY.max_tokens)]
        assert r.token_ids == want
    assert first[0].token_ids != first[1].token_ids
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=12) for s in (1, 1, 2)]
    a, b, c = sim_engine(tiny_llama_dir).generate([ps[0]] * 3, seeded)
    assert a.token_ids == b.token_ids != c.token_ids
    assert a.token_ids != first[0].token_ids


def test_no_eos_is_ever_drawn(tiny_llama_dir: Path) -> None:
    engine = sim_engine(tiny_llama_dir)
    eos = set(engine.tokenizer.eos_token_ids)
    assert eos
    long = SamplingParams(temperature=0.0, max_tokens=200)  # EOS would stop it
    results = engine.generate(prompts(3, [9, 17]), long)
    for r in results:
        assert len(r.token_ids) == 200 and not eos & set(r.token_ids)


def test_the_prefix_cache_serves_the_stand_in_kv(tiny_llama_dir: Path) -> None:
    p = prompts(4, [70])[0]
    # A modelled model of 32 layers on a checkpoint of 4: the KV has the modelled ones.
    engine = sim_engine(tiny_llama_dir, "roofline:h100:llama-3-8b")
    assert engine.layout.num_layers == 32
    (cold,) = engine.generate([p], GREEDY)
    (warm,) = engine.generate([p], GREEDY)
    assert warm.num_cached_tokens == 64 and cold.num_cached_tokens == 0
    assert warm.token_ids == cold.token_ids
    # Decode-side prefix reuse reads the cached blocks out: every layer of the layout.
    hashes = chain_block_hashes(p[:64], engine.config.block_size)
    assert engine.cached_prefix_blocks(hashes) == 4
    cached = engine.export_cached_prefix(hashes)
    assert cached is not None and len(cached.keys) == engine.layout.num_layers
    assert all([int(t) for t in k.reshape(-1)] == p[:64] for k in cached.keys)
    engine.check_no_leaks()


def test_a_handed_over_payload_decodes_like_the_whole_request(tiny_llama_dir: Path) -> None:
    p = prompts(5, [37])[0]
    prefill, decode = sim_engine(tiny_llama_dir), sim_engine(tiny_llama_dir)
    (whole,) = prefill.generate([p], GREEDY)
    prefill.add_request("h", p, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    out = []
    while prefill.has_unfinished():
        out += prefill.step()
    payload = prefill.export_kv("h")
    prefill.release_kv("h")
    want = stand_in_payload(prefill.layout, p)
    assert payload.layout == want.layout and payload.num_tokens == len(p)
    for layer in range(payload.layout.num_layers):  # K: the tokens, V: the positions
        assert np.array_equal(payload.keys[layer], want.keys[layer])
        assert np.array_equal(payload.values[layer], want.values[layer])
    first = (out[-1].new_token_ids[0], 0.0)
    decode.add_request("h", p, GREEDY, kv=payload, first_token=first)
    tokens = [first[0]]
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
    assert tokens == whole.token_ids
    prefill.check_no_leaks()
    decode.check_no_leaks()


def test_a_payload_of_another_prompt_fails_its_request(tiny_llama_dir: Path) -> None:
    p, other = prompts(6, [33, 33])
    engine = sim_engine(tiny_llama_dir)
    engine.add_request(
        "x", p, GREEDY, kv=stand_in_payload(engine.layout, other), first_token=(9, 0.0)
    )
    with pytest.raises(StepFailedError) as err:
        while engine.has_unfinished():
            engine.step()
    assert "does not hold its prompt" in str(err.value.failures["x"])
    engine.check_no_leaks()


def test_a_reordered_payload_is_refused_at_import(tiny_llama_dir: Path) -> None:
    p = prompts(7, [20])[0]
    engine = sim_engine(tiny_llama_dir)
    good = stand_in_payload(engine.layout, p)
    flipped = type(good)(
        good.layout, good.num_tokens, good.keys, tuple(v[::-1] for v in good.values)
    )
    engine.add_request("y", p, GREEDY, kv=flipped, first_token=(9, 0.0))
    with pytest.raises(StepFailedError) as err:
        engine.step()
    assert "cannot import the KV" in str(err.value.failures["y"])
    engine.check_no_leaks()


def test_layer_hooks_fire_per_layer_through_the_step(tiny_llama_dir: Path) -> None:
    """A layer-wise hand-off sees each layer when its share of the step is spent."""
    engine = sim_engine(tiny_llama_dir)
    ticks = Ticks()
    with_runner(engine, ticks)
    seen: list[tuple[int, float, list[int]]] = []

    def hook(layer: int, keys: object, values: object) -> None:
        seen.append((layer, ticks.now, [int(t) for t in keys.reshape(-1)]))  # type: ignore[attr-defined]

    p = prompts(8, [24])[0]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    engine.add_request("l", p, one, layer_hook=hook)
    engine.step()
    step_s = 1e-3 + 24e-5
    assert [layer for layer, _, _ in seen] == [0, 1, 2, 3]
    assert [t - 100.0 for _, t, _ in seen] == pytest.approx(
        [step_s * (i + 1) / 4 for i in range(4)]
    )
    assert all(tokens == p for _, _, tokens in seen)


def test_time_given_away_at_a_checkpoint_is_not_the_step_s_own(tiny_llama_dir: Path) -> None:
    """Under a shared device's gate, a prefill step lets other engines in between layers:
    the step ends its own modelled time after the last of those waits."""
    engine = sim_engine(tiny_llama_dir)
    ticks = Ticks()
    runner = with_runner(engine, ticks)
    calls: list[float] = []

    def checkpoint() -> None:
        calls.append(ticks.now)
        if len(calls) == 2:
            ticks.now += 0.5  # another engine held the device for half a second

    engine.add_request("c", prompts(9, [40])[0], SamplingParams(temperature=0.0, max_tokens=1))
    step = engine.scheduler.schedule()
    runner.execute(step, checkpoint)
    step_s = 1e-3 + 40e-5
    assert len(calls) == 3  # between the four layers
    assert ticks.now - 100.0 == pytest.approx(step_s + 0.5)
    assert calls[2] - 100.0 == pytest.approx(0.5 + step_s * 3 / 4)


@dataclass(frozen=True)
class Slower:
    """``Linear`` taking ``k`` times as long: the engine on fewer threads."""

    k: float

    def step_time(self, step: SimStep) -> float:
        return self.k * Linear().step_time(step)

    def describe(self) -> str:
        return f"linear x {self.k}"


def test_a_step_moved_to_a_share_of_the_threads_prices_its_remaining_layers_there(
    tiny_llama_dir: Path,
) -> None:
    """A host lease's split sets the threads before a step and at its checkpoints
    (``use_threads``): the layers after the change take the share's time."""
    engine = sim_engine(tiny_llama_dir)
    ticks = Ticks()
    old = with_runner(engine, ticks)
    runner = SimRunner(
        Linear(),
        num_blocks=old._kv.size // old.block_size,
        block_size=old.block_size,
        num_layers=old.num_layers,
        vocab_size=engine.model_config.vocab_size,
        on_threads={2: Linear(), 1: Slower(2.0)},
        sleep=ticks.sleep,
        clock=ticks.clock,
    )
    engine.runner = runner
    calls: list[float] = []

    def checkpoint() -> None:
        calls.append(ticks.now)
        if len(calls) == 2:  # after the second of four layers, onto a 1-thread share
            runner.use_threads(1)

    engine.add_request("s", prompts(10, [40])[0], SamplingParams(temperature=0.0, max_tokens=1))
    runner.execute(engine.scheduler.schedule(), checkpoint)
    step_s = 1e-3 + 40e-5
    assert ticks.now - 100.0 == pytest.approx(step_s / 2 + 2 * step_s / 2)
    assert runner.modelled_s == pytest.approx(1.5 * step_s)
    # The next step starts on the share: all of it at the share's time.
    before, sched = ticks.now, engine.scheduler.schedule()
    runner.execute(sched)
    assert ticks.now - before == pytest.approx(2 * Linear().step_time(step_of(sched)))
    with pytest.raises(ValueError, match="no step times on 3 threads"):
        runner.use_threads(3)


def test_a_fitted_profile_s_steps_vary_as_its_measured_ones_did(tiny_llama_dir: Path) -> None:
    """Each step's time is the fit's prediction plus a residual drawn from its spread."""
    shape = ModelShape.from_config(tiny_llama_dir / "config.json")
    fitted = Fitted(1e-3, 1e-5, 1e-4, 0.0, 0.0, shape, "t", 0, 0.0, spread=(0.0, 2e-3))
    engine = sim_engine(tiny_llama_dir)
    ticks = Ticks()
    old = with_runner(engine, ticks)
    runner = SimRunner(
        fitted,
        num_blocks=old._kv.size // old.block_size,
        block_size=old.block_size,
        num_layers=old.num_layers,
        vocab_size=engine.model_config.vocab_size,
        sleep=ticks.sleep,
        clock=ticks.clock,
    )
    engine.runner = runner
    engine.add_request("v", prompts(12, [8])[0], SamplingParams(temperature=0.0, max_tokens=40))
    added = set()
    while engine.has_unfinished():
        before, sched = ticks.now, engine.scheduler.schedule()
        engine.scheduler.update(sched, runner.execute(sched).sampled)
        added.add(round(ticks.now - before - fitted.step_time(step_of(sched)), 9))
    assert added == {0.0, 2e-3}


def test_the_hash_draws_among_what_the_masks_leave(tiny_llama_dir: Path) -> None:
    """allowed_token_ids, bad words, min_tokens's stop tokens and a -100 bias mask tokens; a
    +100 bias forces its token; the rest of the controls (penalties, min_p, other biases)
    change nothing, for the sim has no distribution."""
    engine = sim_engine(tiny_llama_dir)
    p = prompts(12, [11])[0]
    plain = engine.generate([p], GREEDY)[0].token_ids

    def tokens(**kw: object) -> list[int]:
        return engine.generate([p], SamplingParams(**{**vars_of(GREEDY), **kw}))[0].token_ids

    assert set(tokens(allowed_token_ids=(5, 6, 7))) <= {5, 6, 7}
    # EOS only when nothing else is allowed: then it ends the request.
    assert tokens(allowed_token_ids=(2,), max_tokens=3, ignore_eos=False) == [2]
    assert plain[0] not in tokens(bad_words_token_ids=((plain[0],),))
    pair = tokens(bad_words_token_ids=((plain[0], plain[1]),))
    assert pair[0] == plain[0] and pair[1] != plain[1]
    assert tokens(logit_bias={plain[0]: -100.0})[0] != plain[0]
    assert tokens(logit_bias={9: 100.0, plain[0]: 99.0}) == [9] * GREEDY.max_tokens
    held = tokens(stop_token_ids=(plain[0],), min_tokens=2, ignore_eos=False)
    assert plain[0] not in held[:2]
    unchanged = tokens(repetition_penalty=1.8, presence_penalty=2.0, logit_bias={9: 50.0})
    assert unchanged == plain
    dead = SamplingParams(
        temperature=0.0, max_tokens=4, allowed_token_ids=(5, 7),
        bad_words_token_ids=((5,), (6,)), logit_bias={7: -100.0},
    )  # fmt: skip
    engine.add_request("dead", p, dead)
    with pytest.raises(StepFailedError) as failed:
        while engine.has_unfinished():
            engine.step()
    assert "mask" in str(failed.value.failures["dead"])
    engine.check_no_leaks()


def test_the_hash_stays_in_the_guides_grammar(tiny_llama_dir: Path) -> None:
    """A guided request draws only what its grammar allows, EOS where it is complete (which
    ends it); allowed ids the grammar refuses leave nothing, and the request fails alone."""
    pytest.importorskip("xgrammar")
    engine = sim_engine(tiny_llama_dir)
    p = prompts(13, [7])[0]
    choice = Guide.choice(["yes", "no", "maybe so"])
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, guide=choice)
        out = engine.generate([p], params)[0]
        assert out.text in ("yes", "no", "maybe so") and out.finish_reason is FinishReason.STOP
        assert out.token_ids[-1] in engine.tokenizer.eos_token_ids
    digits = engine.tokenizer.encode("7", add_bos=False)
    engine.add_request("dead", p, SamplingParams(guide=choice, allowed_token_ids=tuple(digits)))
    with pytest.raises(StepFailedError) as failed:
        while engine.has_unfinished():
            engine.step()
    assert "mask" in str(failed.value.failures["dead"])
    engine.check_no_leaks()


def vars_of(params: SamplingParams) -> dict[str, object]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}


def test_logprobs_are_a_point_mass(tiny_llama_dir: Path) -> None:
    p = prompts(9, [40])[0]
    asked = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, prompt_logprobs=2)
    # 16-token steps: the prompt's logprobs come in three chunks.
    (r,) = sim_engine(tiny_llama_dir, max_num_batched_tokens=16, max_num_seqs=1).generate(
        [p], asked
    )
    assert [(t.token_ids, t.logprobs) for t in r.top_logprobs] == [
        ((token,), (0.0,)) for token in r.token_ids
    ]
    pl = r.prompt_logprobs
    assert pl is not None and pl.token_ids == p
    assert pl.logprobs == [0.0] * 39 and pl.ranks == [1] * 39
    assert [t.token_ids for t in pl.top] == [(t,) for t in p[1:]]
