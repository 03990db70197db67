"""scripts/shift_trace.py: the planner benchmark's trace, one block of requests per mix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("src", "bench"))}
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "shift_trace.py"), *args],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip


def test_each_mix_gets_its_own_count_and_rate(tmp_path: Path) -> None:
    out = tmp_path / "shift.jsonl"
    done = _run("--out", str(out), "--mixes", "prefill-heavy,decode-heavy",
                "--requests", "300,600", "--rate", "10,60", "--seed", "1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    first, second = lines[:300], lines[300:]
    assert len(second) == 600
    assert all(r["prompt_tokens"] >= 3000 for r in first)
    assert all(r["output_tokens"] > r["prompt_tokens"] for r in second)
    times = [r["arrival_s"] for r in lines]
    assert times == sorted(times)
    # Mean gaps of 1/10 s and 1/60 s: 300 arrivals at 10/s span ~30 s, 600 at 60/s ~10 s.
    span1 = first[-1]["arrival_s"]
    span2 = second[-1]["arrival_s"] - first[-1]["arrival_s"]
    assert 24 < span1 < 36 and 8 < span2 < 12


def test_a_rate_list_of_the_wrong_length_is_refused(tmp_path: Path) -> None:
    done = _run("--out", str(tmp_path / "x.jsonl"), "--mixes", "chat,chat,chat", "--rate", "1,2")
    assert done.returncode == 2 and "--rate" in done.stderr
    done = _run("--out", str(tmp_path / "x.jsonl"), "--requests", "0")
    assert done.returncode == 2 and "--requests" in done.stderr
