"""Steps recorded while serving (a worker's --record-steps) and a profile fit to them
(pdserve sim calibrate --steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError
from pdserve.sim.calibrate import fit_recorded
from pdserve.sim.cli import main_sim
from pdserve.sim.fitted import Fitted
from pdserve.sim.recording import CalibrationPlan, StepLog, read_step_logs, record_plan
from pdserve.sim.shapes import ModelShape
from pdserve.sim.timing import SimStep
from pdserve.worker.runtime import record_steps


def _engine(model_dir: Path) -> Engine:
    return Engine.from_pretrained(
        model_dir, dtype="float32", enable_prefix_caching=True, num_kv_blocks=256
    )


def test_a_serving_engine_s_steps_land_in_the_log(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import torch

    engine = _engine(tiny_llama_dir)
    log = tmp_path / "steps.jsonl"
    record_steps(engine, log)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", list(range(10, 40)), params)
    while engine.has_unfinished():
        engine.step()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0]["prefills"] == [[30, 0]] and lines[0]["decodes"] == []
    assert [line["decodes"] for line in lines[1:]] == [[31], [32], [33]]  # contexts
    assert all(line["threads"] == torch.get_num_threads() for line in lines)
    assert all(line["seconds"] > 0 for line in lines)
    by_threads = read_step_logs([log])
    assert by_threads[torch.get_num_threads()][0][0] == SimStep(((30, 0),))


def test_a_profile_fit_to_recorded_steps(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    samples = record_plan(_engine(tiny_llama_dir), CalibrationPlan.quick())
    log = tmp_path / "steps.jsonl"
    on: list[int] = [2]
    sink = StepLog(log, lambda: on[0])
    for step, seconds in samples:  # as if on every thread, then on a share of a split
        sink(step, seconds)
    on[0] = 1
    for step, seconds in samples:
        sink(step, seconds * 1.5)
    sink.close()
    out = tmp_path / "fitted.json"
    argv = ["calibrate", "--model", str(tiny_llama_dir), "--out", str(out)]
    assert main_sim([*argv, "--dtype", "float32", "--steps", str(log)]) == 0
    assert f"recorded in {log}" in capsys.readouterr().out
    fitted = Fitted.load(out)
    assert fitted.threads == 2 and [s.threads for s in fitted.shares] == [1]
    assert "recorded while serving" in fitted.device
    step = samples[0][0]
    share = fitted.on_threads(1)
    assert share is not None
    assert share.step_time(step) == pytest.approx(1.5 * fitted.step_time(step), rel=1e-6)


def test_bad_logs_are_refused_naming_the_flag(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prefills": [[4, 0]], "decodes": [], "threads": 2, "seconds": 0.1}\n{')
    with pytest.raises(InvalidArgumentError) as e:
        read_step_logs([bad])
    assert e.value.field == "--steps" and f"{bad}:2" in str(e.value)
    bad.write_text('{"prefills": [], "decodes": [], "threads": 2, "seconds": 0.1}\n')
    with pytest.raises(InvalidArgumentError, match="not a step that ran"):
        read_step_logs([bad])
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        read_step_logs([tmp_path / "missing.jsonl"])


def test_steps_that_do_not_vary_enough_are_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    shape = ModelShape.from_config(tiny_llama_dir / "config.json", flag="--model")
    same = [(SimStep(decodes=(40,)), 0.01)] * 20  # one shape only: nothing to tell apart
    with pytest.raises(InvalidArgumentError) as e:
        fit_recorded({2: same}, shape, "float32")
    assert e.value.field == "--steps" and "2 threads" in str(e.value)
    with pytest.raises(InvalidArgumentError, match="no recorded step"):
        fit_recorded({}, shape, "float32")
