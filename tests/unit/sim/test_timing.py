"""Step times of the roofline and fitted models, the fit, and --sim-profile parsing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from pdserve.errors import InvalidArgumentError
from pdserve.sim.fitted import FASTEST, SPREAD_POINTS, Fitted, features, fit
from pdserve.sim.profile import parse_profile
from pdserve.sim.shapes import MODELS, Accelerator, ModelShape, accelerator
from pdserve.sim.timing import Roofline, SimStep, step_of

TINY = ModelShape("tiny", 2, 8, 2, 1, 4, 16, 10)
# Round numbers so that every term below is computed by hand.
TOY = Accelerator("toy", 1000.0, 100.0, 10**6, 1000.0, 0.5, 0.5, 0.001)
LLAMA = MODELS["llama-3-8b"]
H100 = accelerator("h100")

# One chunk of 3 tokens after 2 cached, two decodes at contexts 5 and 7.
MIXED = SimStep(prefills=((3, 2),), decodes=(5, 7))


def test_step_counts() -> None:
    assert MIXED.prefill_tokens == 3
    assert MIXED.num_decodes == 2
    assert MIXED.num_tokens == 5
    # chunk: queries see 3, 4, 5 keys; decodes 5 and 7
    assert MIXED.attention_pairs == 3 + 4 + 5 + 5 + 7
    assert MIXED.prefix_tokens == 2
    assert MIXED.decode_context == 12
    assert SimStep().is_empty and not MIXED.is_empty


@pytest.mark.parametrize(
    "bad", [{"prefills": ((0, 0),)}, {"prefills": ((1, -1),)}, {"decodes": (0,)}]
)
def test_step_refuses_impossible_shapes(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SimStep(**bad)


def test_step_of_scheduler_output() -> None:
    def chunk(computed: int, n: int) -> ScheduledChunk:
        return ScheduledChunk(SimpleNamespace(num_computed_tokens=computed), n)  # type: ignore[arg-type]

    out = SchedulerOutput(
        decodes=(chunk(9, 1), chunk(40, 1)),
        prefills=(chunk(0, 16), chunk(32, 8)),
        preempted=(),
    )
    assert step_of(out) == SimStep(prefills=((16, 0), (8, 32)), decodes=(10, 41))
    assert step_of(SchedulerOutput((), (), ())) == SimStep()


def test_roofline_tiny_by_hand() -> None:
    r = Roofline(TOY, TINY)
    # matmuls 2*1152*5 rows, LM head 2*80*3 sampling rows, attention 4*2*2*4*24 pairs
    assert r.flops(MIXED) == 11520 + 480 + 1536
    # weights 2624 + KV read 32*(12 + 2) + KV written 32*5
    assert r.bytes_moved(MIXED) == 2624 + 448 + 160
    assert r.compute_s(MIXED) == pytest.approx(13536 / 500)
    assert r.memory_s(MIXED) == pytest.approx(3232 / 50)
    assert r.tp_comm_s(MIXED) == 0.0
    assert r.step_time(MIXED) == pytest.approx(0.001 + 64.64)
    assert r.step_time(SimStep()) == 0.0


def test_roofline_tiny_tp2_by_hand() -> None:
    r = Roofline(TOY, TINY, tp=2)
    # all-reduce of 5 rows * 8 hidden * 2 bytes: ring moves 2*(1/2)*80 bytes at 1000 B/s,
    # twice per layer, two layers, each with 5 us latency
    assert r.tp_comm_s(MIXED) == pytest.approx(4 * (0.08 + 5e-6))
    assert r.step_time(MIXED) == pytest.approx(0.001 + 3232 / 100 + 4 * (0.08 + 5e-6))


def test_llama_decode_is_memory_bound_by_hand() -> None:
    r = Roofline(H100, LLAMA)
    step = SimStep(decodes=(2048,))
    # all weights (8,029,995,008 bf16 params) + 2048 cached tokens read + 1 written
    expected_bytes = 16059990016 + 131072 * 2048 + 131072
    assert r.bytes_moved(step) == expected_bytes
    assert r.compute_s(step) < r.memory_s(step) / 100
    assert r.step_time(step) == pytest.approx(0.001 + expected_bytes / (3.35e12 * 0.8))


def test_llama_long_prefill_is_compute_bound() -> None:
    r = Roofline(H100, LLAMA)
    step = SimStep(prefills=((4096, 0),))
    flops = 2 * 6979321856 * 4096 + 2 * 4096 * 128256 + 4 * 32 * 32 * 128 * (4096 * 4097 // 2)
    assert r.flops(step) == flops
    assert r.memory_s(step) < r.compute_s(step)
    assert r.step_time(step) == pytest.approx(0.001 + flops / (989e12 * 0.6))


@pytest.mark.parametrize("step", [SimStep(decodes=(2048,)), SimStep(prefills=((4096, 0),)), MIXED])
def test_tp2_faster_but_not_twice(step: SimStep) -> None:
    one = Roofline(H100, LLAMA).step_time(step)
    two = Roofline(H100, LLAMA, tp=2).step_time(step)
    assert one / 2 < two < one


def test_roofline_refuses_tp0() -> None:
    with pytest.raises(InvalidArgumentError):
        Roofline(H100, LLAMA, tp=0)


def test_kv_capacity() -> None:
    r = Roofline(H100, LLAMA)
    expected = (80 * 2**30 * 0.9 - 16059990016) // 131072
    assert r.kv_capacity_tokens() == expected
    assert Roofline(H100, LLAMA, tp=2).kv_capacity_tokens() > 2 * expected
    assert r.kv_capacity_tokens(0.5) < expected


def test_kv_capacity_refuses_70b_on_one_h100() -> None:
    with pytest.raises(InvalidArgumentError) as e:
        Roofline(H100, MODELS["llama-3-70b"]).kv_capacity_tokens()
    assert e.value.field == "--sim-profile"
    assert "tp2" in str(e.value)
    assert Roofline(H100, MODELS["llama-3-70b"], tp=2).kv_capacity_tokens() > 0


# --- fitted --------------------------------------------------------------------------------

TRUE = Fitted(
    overhead_s=1.5e-3,
    prefill_token_s=4e-5,
    decode_seq_s=2e-5,
    attention_pair_s=3e-10,
    kv_read_token_s=2e-9,
    model=LLAMA,
    device="test",
    samples=0,
    rel_error=0.0,
)


def varied_steps() -> list[SimStep]:
    steps = [SimStep(decodes=tuple(range(100, 100 + 37 * b, 37))) for b in (1, 4, 16, 64, 128)]
    steps += [SimStep(decodes=(4000,) * b) for b in (1, 8, 32)]
    steps += [SimStep(prefills=((n, 0),)) for n in (16, 128, 512, 2048, 8192)]
    steps += [SimStep(prefills=((n, c),)) for n, c in ((64, 4096), (512, 1024), (256, 16384))]
    steps += [SimStep(prefills=((512, 256),), decodes=(300,) * 20)]
    return steps


def test_fit_recovers_coefficients() -> None:
    samples = [(s, TRUE.step_time(s)) for s in varied_steps()]
    got = fit(samples, LLAMA, "h100 lab")
    for name in ("overhead_s", "prefill_token_s", "decode_seq_s", "attention_pair_s",
                 "kv_read_token_s"):  # fmt: skip
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=0.01), name
    assert got.samples == len(samples)
    assert got.rel_error < 1e-6
    assert got.model is LLAMA and got.device == "h100 lab"


def test_fit_keeps_coefficients_non_negative() -> None:
    # Times that fall slightly with the KV read (as noise can make them): unconstrained least
    # squares gives that coefficient a negative value; the fit fixes it at 0 instead.
    steps = varied_steps()
    X = np.array([features(s) for s in steps])
    y = X @ np.array([1e-3, 5e-5, 1e-5, 2e-10, -1e-9]) + 2e-3
    free = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)[0]
    assert free[4] < 0  # the premise: this data does push the coefficient negative
    got = fit(list(zip(steps, y.tolist(), strict=True)), LLAMA, "t")
    assert min(got.coefficients) >= 0.0
    assert got.kv_read_token_s == 0.0
    assert got.prefill_token_s == pytest.approx(5e-5, rel=0.2)
    assert got.rel_error > 0.0


def test_fit_weights_relative_error() -> None:
    # One slow outlier among long prefills: an unweighted fit would let it drag the small
    # decode steps off by 2x; weighted by 1/seconds they stay within a few percent.
    samples = [(s, TRUE.step_time(s)) for s in varied_steps()]
    huge = SimStep(prefills=((16384, 0),))
    samples.append((huge, TRUE.step_time(huge) * 1.5))
    got = fit(samples, LLAMA, "t")
    small = SimStep(decodes=(100,))
    assert got.step_time(small) == pytest.approx(TRUE.step_time(small), rel=0.02)


def test_fit_refuses_too_few_or_uniform_samples() -> None:
    steps = varied_steps()
    with pytest.raises(InvalidArgumentError) as e:
        fit([(s, TRUE.step_time(s)) for s in steps[:4]], LLAMA, "t")
    assert e.value.field == "samples"
    decodes_only = [SimStep(decodes=(100 * b,) * b) for b in range(1, 10)]
    with pytest.raises(InvalidArgumentError) as e:
        fit([(s, TRUE.step_time(s)) for s in decodes_only], LLAMA, "t")
    assert e.value.field == "samples"
    bad_time = [(s, TRUE.step_time(s)) for s in steps]
    bad_time[3] = (bad_time[3][0], 0.0)
    with pytest.raises(InvalidArgumentError):
        fit(bad_time, LLAMA, "t")


def test_fitted_step_time() -> None:
    # 1.5e-3 + 3*4e-5 + 2*2e-5 + 24*3e-10 + 14*2e-9
    assert TRUE.step_time(MIXED) == pytest.approx(1.5e-3 + 1.2e-4 + 4e-5 + 7.2e-9 + 2.8e-8)
    assert TRUE.step_time(SimStep()) == 0.0


def test_fitted_save_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "fit.json"
    TRUE.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "pdserve-sim-fitted" and data["version"] == 1
    assert Fitted.load(path) == TRUE
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(format="other"),
        lambda d: d.update(version=2),
        lambda d: d.pop("device"),
        lambda d: d.pop("model"),
        lambda d: d["coefficients"].pop("decode_seq_s"),
        lambda d: d["coefficients"].update(prefill_token_s=-1e-6),
        lambda d: d["coefficients"].update(overhead_s="fast"),
        lambda d: d["model"].pop("vocab_size"),
        lambda d: d.update(samples=-3),
        lambda d: d["shares"][0].update(threads=2),  # not fewer than the whole's
        lambda d: d["shares"][0].update(threads=0),
        lambda d: d["shares"][0]["coefficients"].pop("overhead_s"),
        lambda d: d.update(shares={"1": {}}),
        lambda d: d.update(threads=True),
        lambda d: d.update(spread=[1.2, 1.0]),  # not ascending
        lambda d: d.update(spread=["slow"]),
        lambda d: d.update(spread="wide"),
    ],
)
def test_fitted_load_refuses_bad_files(tmp_path: Path, mutate: Any) -> None:
    data = _split_host().to_json()  # with a share, so its checks run too
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidArgumentError) as e:
        Fitted.load(path, flag="--prof")
    assert e.value.field == "--prof"
    assert str(path) in str(e.value)


def _split_host() -> Fitted:
    """TRUE measured on 2 threads, with a slower fit on a 1-thread share."""
    one = dataclasses.replace(TRUE, overhead_s=2.5e-3, prefill_token_s=7e-5, threads=1)
    return dataclasses.replace(TRUE, threads=2, shares=(one,))


def test_fitted_shares_round_trip_and_price_each_thread_count(tmp_path: Path) -> None:
    split = _split_host()
    path = tmp_path / "split.json"
    split.save(path)
    loaded = Fitted.load(path)
    assert loaded == split
    share = loaded.on_threads(1)
    assert share is not None and share.threads == 1
    assert share.step_time(MIXED) > loaded.step_time(MIXED)
    assert loaded.on_threads(2) is loaded
    assert loaded.on_threads(3) is None
    on = parse_profile(f"fitted:{path}").on_threads
    assert sorted(on) == [1, 2] and on[1] == share
    # A profile without shares (or an accelerator's) models no split.
    TRUE.save(path)
    assert Fitted.load(path).threads == 0
    assert parse_profile(f"fitted:{path}").on_threads == {}
    assert parse_profile("roofline:h100:llama-3-8b").on_threads == {}


def test_the_fit_keeps_how_the_steps_varied_about_it(tmp_path: Path) -> None:
    steps = varied_steps() * 8
    stall = [0.0, 0.0, 0.0, -1e-5, 1e-5, 0.0, 0.0, 0.02]  # one step in eight waits 20 ms
    samples = [(s, TRUE.step_time(s) + stall[i % 8]) for i, s in enumerate(steps)]
    fitted = fit(samples, LLAMA, "t")
    assert len(fitted.spread) == SPREAD_POINTS
    assert list(fitted.spread) == sorted(fitted.spread)
    short = 0.01
    assert fitted.varied(short, 0.5) == pytest.approx(short, abs=2e-3)
    assert fitted.varied(short, 0.999) - fitted.varied(short, 0.5) == pytest.approx(0.02, rel=0.2)
    assert fitted.varied(short, 0.0) >= FASTEST * short
    path = tmp_path / "spread.json"
    fitted.save(path)
    assert Fitted.load(path) == fitted
    assert TRUE.varied(short, 0.999) == short  # no spread: every step its predicted time


def test_a_file_from_before_thread_counts_loads(tmp_path: Path) -> None:
    data = TRUE.to_json()
    del data["threads"], data["shares"], data["spread"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert Fitted.load(path) == TRUE


@pytest.mark.parametrize("text", ["{", "[]", "null"])
def test_fitted_load_refuses_non_profiles(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError) as e:
        Fitted.load(path)
    assert str(path) in str(e.value)


# --- parse_profile -------------------------------------------------------------------------


def test_parse_roofline_forms(tmp_path: Path) -> None:
    p = parse_profile("roofline:h100:llama-3-8b")
    assert isinstance(p.timing, Roofline)
    assert p.timing.tp == 1 and p.timing.accelerator.name == "h100-sxm"
    assert p.model is LLAMA
    assert p.kv_tokens == p.timing.kv_capacity_tokens()
    assert p.spec == "roofline:h100:llama-3-8b"

    p2 = parse_profile("roofline:a100-80gb:qwen2-7b:tp4")
    assert isinstance(p2.timing, Roofline)
    assert p2.timing.tp == 4 and p2.timing.accelerator.name == "a100-80gb"
    assert p2.model.name == "qwen2-7b"


def test_parse_roofline_config_paths(tmp_path: Path) -> None:
    directory = tmp_path / "odd:name"
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "vocab_size": 100,
            }
        )
    )
    p = parse_profile(f"roofline:h100:{directory / 'config.json'}")
    assert p.model.num_layers == 2 and p.model.name == "odd:name"
    p2 = parse_profile(f"roofline:h100:{directory}:tp2")
    assert isinstance(p2.timing, Roofline) and p2.timing.tp == 2
    assert p2.model.hidden_size == 64


def test_parse_fitted(tmp_path: Path) -> None:
    path = tmp_path / "fit.json"
    TRUE.save(path)
    p = parse_profile(f"fitted:{path}")
    assert p.timing == TRUE
    assert p.model == LLAMA
    assert p.kv_tokens is None
    assert "test" in p.timing.describe()


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("roofline:tpu-v5:llama-3-8b", "tpu-v5"),
        ("roofline:h100:gpt-17", "gpt-17"),
        ("measured:h100:llama-3-8b", "roofline:<accelerator>:<model>"),
        ("roofline:h100:llama-3-8b:tp0", "tp"),
        ("", "fitted:<file.json>"),
        ("roofline", "roofline:<accelerator>:<model>"),
        ("roofline:h100", "roofline:<accelerator>:<model>"),
        ("roofline:h100:tp2", "tp2"),
        ("fitted:", "fitted:<file.json>"),
        ("fitted:/nonexistent/fit.json", "/nonexistent/fit.json"),
        ("roofline:h100:llama-3-70b", "tp2"),
    ],
)
def test_parse_profile_refusals(spec: str, needle: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        parse_profile(spec, flag="--sim-profile-x")
    assert e.value.field == "--sim-profile-x"
    assert needle in str(e.value)


def test_seventy_b_fits_two_h100s() -> None:
    p = parse_profile("roofline:h100:llama-3-70b:tp2")
    assert p.kv_tokens is not None and p.kv_tokens > 10_000
