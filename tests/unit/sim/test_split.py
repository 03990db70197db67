"""A sim engine on a host lease splits the modelled CPU's threads as torch engines do, where
its profile was measured on the split's shares (``sim.backend.sim_split``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.compute.lease import CoreSplit
from pdserve.errors import InvalidArgumentError
from pdserve.sim.backend import SimOptions, sim_backend, sim_split
from pdserve.sim.fitted import Fitted
from pdserve.sim.profile import parse_profile
from pdserve.sim.runner import SimRunner
from pdserve.sim.shapes import MODELS

WHOLE = Fitted(2e-3, 4e-5, 2e-5, 3e-10, 2e-9, MODELS["llama-3-8b"], "test", 0, 0.0, threads=2)
ONE = dataclasses.replace(WHOLE, overhead_s=3e-3, prefill_token_s=8e-5, threads=1)


def _profile(tmp_path: Path, fitted: Fitted) -> str:
    path = tmp_path / "profile.json"
    fitted.save(path)
    return f"fitted:{path}"


def test_split_only_where_the_profile_measured_its_shares(tmp_path: Path) -> None:
    split = sim_split(parse_profile(_profile(tmp_path, WHOLE)), None, lambda n: None)
    assert split is None  # measured on every thread only: the engines take turns
    assert sim_split(parse_profile("roofline:h100:llama-3-8b"), None, lambda n: None) is None
    shared = parse_profile(_profile(tmp_path, dataclasses.replace(WHOLE, shares=(ONE,))))
    split = sim_split(shared, None, lambda n: None)
    assert split is not None and (split.threads, split.interactive, split.bulk) == (2, 1, 1)
    assert sim_split(shared, 0, lambda n: None) is None  # --lease-split-threads 0: turns


def test_a_split_the_profile_cannot_price_is_refused_naming_the_flag(tmp_path: Path) -> None:
    four = dataclasses.replace(WHOLE, threads=4, shares=(dataclasses.replace(ONE, threads=2),))
    profile = parse_profile(_profile(tmp_path, four))
    assert sim_split(profile, None, lambda n: None) is not None  # 2 and 2: measured
    with pytest.raises(InvalidArgumentError) as e:
        sim_split(profile, 1, lambda n: None)  # 1 and 3: not measured
    assert e.value.field == "--lease-split-threads"
    assert "[2, 4]" in str(e.value)


def test_the_lease_s_thread_counts_reach_the_runner(tiny_llama_dir: Path, tmp_path: Path) -> None:
    options = SimOptions.parse(_profile(tmp_path, dataclasses.replace(WHOLE, shares=(ONE,))))
    splits: list[CoreSplit | None] = []

    def lease(split: CoreSplit | None) -> None:
        splits.append(split)

    backend = sim_backend(tiny_llama_dir, options, lease=lease, num_kv_blocks=64)  # type: ignore[arg-type]
    runner = backend.engine.engine.runner
    assert isinstance(runner, SimRunner)
    (split,) = splits
    assert split is not None
    split.set_threads(split.interactive)
    assert runner.timing == ONE
    split.set_threads(split.threads)
    assert runner.timing == dataclasses.replace(WHOLE, shares=(ONE,))
