"""Calibration: the torch engine's measured steps fitted into a ``Fitted`` profile.

Step times vary with the machine's load, so these tests check structure only: which steps
were recorded with which ``SimStep``, that the profile file round-trips with the checkpoint's
shape and non-negative coefficients, and what the command line prints and refuses.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.cli import main as pdserve_main
from pdserve.compute.omp import OMP_WAIT_POLICY, WORKER_WAIT_POLICY
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.errors import InvalidArgumentError
from pdserve.sim.calibrate import calibrate, split_shares
from pdserve.sim.cli import main_sim
from pdserve.sim.fitted import Fitted
from pdserve.sim.profile import parse_profile
from pdserve.sim.recording import CalibrationPlan, RecordingRunner, record_plan
from pdserve.sim.shapes import ModelShape
from pdserve.sim.timing import SimStep


def _expected(out: SchedulerOutput) -> SimStep:
    """What the step computes, read off the scheduler's chunks before it runs."""
    return SimStep(
        prefills=tuple((c.num_tokens, c.seq.num_computed_tokens) for c in out.prefills),
        decodes=tuple(c.seq.num_computed_tokens + 1 for c in out.decodes),
    )


def test_recorder_records_each_executed_step_as_scheduled(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine.from_pretrained(
        tiny_llama_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=8
    )
    inner = engine.runner
    recorder = RecordingRunner(inner)
    engine.runner = recorder
    scheduled: list[SimStep] = []
    schedule = engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        out = schedule()
        if not out.is_empty:
            scheduled.append(_expected(out))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", spy)
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, n in enumerate((40, 10, 5)):  # 40 > the budget: chunked, the second chunk has context
        engine.add_request(f"r{i}", [rng.randrange(2048) for _ in range(n)], params)
        if i < 2:
            engine.step()  # r2 arrives while r0 and r1 decode: a mixed step
    while engine.has_unfinished():
        engine.step()

    assert [step for step, _ in recorder.samples] == scheduled
    assert all(seconds > 0 for _, seconds in recorder.samples)
    steps = [step for step, _ in recorder.samples]
    assert any(c > 0 for s in steps for _, c in s.prefills)  # a chunk after an earlier one
    assert any(s.prefills and s.decodes for s in steps)  # a mixed step

    recorded = len(recorder.samples)
    recorder.recording = False
    engine.add_request("quiet", [1, 2, 3], params)
    while engine.has_unfinished():
        engine.step()
    assert len(scheduled) > recorded  # the quiet steps ran...
    assert len(recorder.samples) == recorded  # ...unrecorded
    engine.check_no_leaks()


def test_record_plan_runs_every_planned_shape(tiny_llama_dir: Path) -> None:
    plan = CalibrationPlan.quick()
    engine = Engine.from_pretrained(
        tiny_llama_dir,
        dtype="float32",
        num_kv_blocks=plan.kv_blocks(16, 128),
        max_num_batched_tokens=128,
    )
    lines: list[str] = []
    samples = record_plan(engine, plan, lines.append)
    steps = [step for step, _ in samples]

    for n in plan.prompt_lengths:  # a prefix-hit's first prompt is a fresh prefill too
        heads = sum(cached == n for cached, _ in plan.prefix_hits)
        assert steps.count(SimStep(prefills=((n, 0),))) == plan.repeats * (1 + heads)
    for cached, new in plan.prefix_hits:
        assert steps.count(SimStep(prefills=((new, cached),))) == plan.repeats
    decodes = [s for s in steps if not s.prefills]
    for batch in plan.decode_batches:
        for context in plan.decode_contexts:
            most = context + plan.decode_tokens(batch, context, 128)  # the prompt + max_tokens
            got = [
                s
                for s in decodes
                if len(s.decodes) == batch and context < min(s.decodes) and max(s.decodes) <= most
            ]
            assert len(got) == plan.repeats, (batch, context)
    assert all(seconds > 0 for _, seconds in samples)
    assert lines[0].startswith("warm-up")
    assert isinstance(engine.runner, RecordingRunner)
    engine.check_no_leaks()  # every request finished or aborted, every block free


def test_record_plan_needs_prefix_caching(tiny_llama_dir: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama_dir, dtype="float32", enable_prefix_caching=False)
    with pytest.raises(InvalidArgumentError) as e:
        record_plan(engine, CalibrationPlan.quick())
    assert e.value.field == "enable_prefix_caching"


def test_plan_capped_to_the_model_length_and_validated() -> None:
    plan = CalibrationPlan().capped(300)
    assert max(plan.prompt_lengths) <= 299
    assert max(plan.decode_contexts) + plan.repeats < 300
    assert all(c + n < 300 for c, n in plan.prefix_hits)
    assert len(set(plan.prompt_lengths)) == len(plan.prompt_lengths)
    with pytest.raises(InvalidArgumentError) as e:
        CalibrationPlan(repeats=0)
    assert e.value.field == "repeats"
    with pytest.raises(InvalidArgumentError):
        CalibrationPlan(decode_batches=())


def _check_profile(path: Path, model_dir: Path) -> Fitted:
    profile = parse_profile(f"fitted:{path}")
    fitted = profile.timing
    assert isinstance(fitted, Fitted)
    assert profile.model == ModelShape.from_config(model_dir / "config.json")
    assert profile.model.dtype_bytes == 4  # float32 ran
    assert all(c >= 0 for c in fitted.coefficients)
    assert fitted.overhead_s > 0 or fitted.prefill_token_s > 0 or fitted.decode_seq_s > 0
    assert "float32" in fitted.device
    assert fitted.step_time(SimStep(prefills=((64, 0),))) > 0
    return fitted


def test_calibrate_quick_writes_a_loadable_profile(tiny_llama_dir: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    fitted = calibrate(
        tiny_llama_dir, CalibrationPlan.quick(), dtype="float32", progress=lines.append
    )
    path = tmp_path / "profile.json"
    fitted.save(path)
    loaded = _check_profile(path, tiny_llama_dir)
    assert loaded == fitted
    assert fitted.samples >= 20
    assert any(line.startswith("decode batch") for line in lines)


def test_cli_calibrate_quick_end_to_end(
    tiny_llama_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Unset, so the CLI must adopt the workers' policy itself (setenv first: restored after).
    monkeypatch.setenv(OMP_WAIT_POLICY, "unset-by-test")
    monkeypatch.delenv(OMP_WAIT_POLICY)
    out = tmp_path / "cpu.json"
    argv = ["calibrate", "--model", str(tiny_llama_dir), "--out", str(out), "--quick"]
    assert main_sim([*argv, "--dtype", "float32", "--repeats", "2"]) == 0
    printed = capsys.readouterr().out
    fitted = _check_profile(out, tiny_llama_dir)
    assert f"{OMP_WAIT_POLICY}={WORKER_WAIT_POLICY}" in fitted.device  # as the workers run
    # Measured again on each share of a host lease's split, as the workers step under one.
    assert fitted.threads >= 1
    assert tuple(s.threads for s in fitted.shares) == split_shares(fitted.threads)
    # Each share measured while the companion load kept the other threads busy.
    assert all("busy threads" in s.device for s in fitted.shares)
    assert printed.count("fitted ") == 1 + len(fitted.shares)
    assert f"OpenMP wait policy {WORKER_WAIT_POLICY}" in printed
    assert "machine:" in printed
    assert "isa:" in printed
    assert "overhead_s" in printed
    assert "median relative error" in printed
    assert f"wrote {out}" in printed
    assert f"--backend sim --sim-profile fitted:{out}" in printed


def test_cli_refuses_a_missing_or_bad_model_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "p.json")
    with pytest.raises(InvalidArgumentError) as e:
        main_sim(["calibrate", "--model", str(tmp_path / "nope"), "--out", out])
    assert e.value.field == "--model"
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgumentError) as e:
        main_sim(["calibrate", "--model", str(tmp_path / "empty"), "--out", out])
    assert e.value.field == "--model"
    # Through the dispatcher: a message naming the flag and status 2, no traceback.
    assert pdserve_main(["sim", "calibrate", "--model", str(tmp_path / "nope"), "--out", out]) == 2
    assert "--model" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
