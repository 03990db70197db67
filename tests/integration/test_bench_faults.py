"""``pdserve bench faults`` end to end on one scenario: it kills, checks and reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.errors import InvalidArgumentError
from pdserve_bench.faults.cli import main
from pdserve_bench.faults.scenarios import pick

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("kind", "victim"),
    [
        ("scheduler-replica", "scheduler-1"),
        # The gateway comes back on the port it had (a free one at first): its clients
        # reconnect (it used to come back on another free port, every later request lost).
        ("gateway", "gateway"),
    ],
)
def test_a_scenario_runs_and_reports(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str,
    victim: str,
) -> None:  # fmt: skip
    out = tmp_path / "faults.json"
    rc = main(["--model", str(tiny_llama_dir), "--kinds", kind, "--rate", "2",
               "--warmup-s", "2", "--window-s", "3", "--json", str(out)])  # fmt: skip
    (result,) = json.loads(out.read_text())["results"]
    assert rc == 0, result
    assert result["scenario"] == kind and result["victim"] == victim
    assert result["sent"] == result["ok"] == 10 and result["lost"] == result["wrong"] == 0
    assert result["victim_restarts"] == 1
    assert result["clean_after_s"] is not None and not any(result["left"].values())
    assert f"| {kind} " in capsys.readouterr().out


def test_unknown_kinds_are_named() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown routr; known: router"):
        pick(["routr"])
