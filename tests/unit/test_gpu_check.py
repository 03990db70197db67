"""scripts/gpu_check.sh: skips what the machine lacks with the reason and exits 0; where
``tensorrt_llm`` imports (here the stand-in of tests/fakes) it runs a disaggregated request
and reports it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def gpu_check(tmp_path: Path, extra_path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": extra_path}
    env["FAKE_TENSORRT_LLM_KV_DIR"] = str(tmp_path / "kv")
    return subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def summary(out: str) -> dict[str, str]:
    lines = out.split("GPU check summary", 1)[1].splitlines()[1:]
    return {line.split()[1]: line.split()[0] for line in lines if line.strip()}


def test_skips_what_the_machine_lacks(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the CUDA check would run, not skip")
    try:
        import tensorrt_llm  # noqa: F401

        pytest.skip("tensorrt_llm imports here: the TensorRT-LLM check would run, not skip")
    except ImportError:
        pass
    done = gpu_check(tmp_path, "")
    assert done.returncode == 0, done.stdout + done.stderr
    verdicts = summary(done.stdout)
    assert verdicts == {"torch-cuda-parity": "SKIP", "tensorrt-llm-disaggregated": "SKIP"}
    assert "no CUDA device" in done.stdout and "NVIDIA publishes" in done.stdout


@pytest.mark.slow
def test_runs_a_disaggregated_request_where_tensorrt_llm_imports(tmp_path: Path) -> None:
    fakes = str(ROOT / "tests" / "fakes")
    done = gpu_check(tmp_path, fakes)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(done.stdout)["tensorrt-llm-disaggregated"] == "PASS"
    assert "3/3 disaggregated requests matched" in done.stdout
    assert "the test stand-in, not TensorRT-LLM" in done.stdout
    assert (tmp_path / "out" / "trtllm_disagg.json").is_file()
    assert not list((tmp_path / "kv").glob("*.kv"))  # every hand-off was read once
