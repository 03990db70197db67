"""Workers on the tensorrt-llm backend as real processes (``--backend tensorrt-llm``): Redis,
KV store, scheduler, router and the workers of a local cluster, greedy outputs checked token
for token.

Where TensorRT-LLM is not installed the workers run on the stand-in package of tests/fakes
(put on their ``PYTHONPATH``), which computes with pdserve's engine, so the outputs must equal
the engine's alone; the wiring (flags, native hand-off through the KVHandle, heartbeats,
recompute) is the real one. Where TensorRT-LLM imports, the same cluster runs on it and the
disaggregated outputs must equal the colocated ones.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from pdserve.backends.tensorrt_llm_api import unavailable
from pdserve.client import Client
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.launcher import Cluster, read_heartbeats
from pdserve.models.demo import init_checkpoint

pytestmark = pytest.mark.integration

FAKES = Path(__file__).resolve().parents[1] / "fakes"
WORKER_ARGS = ("--heartbeat-interval-s", "0.2")
MAX_TOKENS = 12


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(4, 2048) for _ in range(n)] for n in (4, 31, 90)]


def generate_all(cluster: Cluster) -> tuple[list[list[int]], set[str]]:
    """Greedy tokens of each prompt, and the transports the hand-offs reported."""
    got, transports = [], set()
    with Client(cluster.router_address, timeout=120) as client:
        for p in prompts():
            done = client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            got.append(done.token_ids)
            transports.add(done.timing.transport)
    return got, transports


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(tmp_path_factory.mktemp("backends_model"), "tiny", dtype="float32")


def test_disaggregated_on_the_stand_in(model_dir: Path, tmp_path: Path) -> None:
    kv_dir = tmp_path / "transceiver"
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(FAKES), os.environ.get("PYTHONPATH")) if p),
        "FAKE_TENSORRT_LLM_KV_DIR": str(kv_dir),
    }
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = Engine.from_pretrained(model_dir, dtype="float32").generate(prompts(), greedy)
    with Cluster(
        model_dir,
        backend="tensorrt-llm",
        worker_args=[*WORKER_ARGS, "--dtype", "float32"],
        env=env,
        log_dir=tmp_path / "logs",
    ) as cluster:
        got, transports = generate_all(cluster)
        beats = read_heartbeats(cluster.redis_url or "")
    assert got == [r.token_ids for r in reference]
    assert transports == {"native"}  # the engines moved the KV; pdserve carried the handle
    assert {b.role.value for b in beats} == {"prefill", "decode"}
    assert all(b.model_fingerprint.startswith("tensorrt-llm/") for b in beats)
    assert all(b.kv_blocks_total > 0 and b.block_size == 32 for b in beats)
    assert kv_dir.is_dir() and not list(kv_dir.glob("*.kv"))  # every hand-off was pulled once


def test_recompute_on_the_stand_in(model_dir: Path, tmp_path: Path) -> None:
    """``--transport recompute``: no KV moves; the decode worker's engine computes the
    prompt again, and the tokens are the same."""
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(FAKES), os.environ.get("PYTHONPATH")) if p),
        "FAKE_TENSORRT_LLM_KV_DIR": str(tmp_path / "transceiver"),
    }
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = Engine.from_pretrained(model_dir, dtype="float32").generate(prompts(), greedy)
    with Cluster(
        model_dir,
        backend="tensorrt-llm",
        worker_args=[*WORKER_ARGS, "--dtype", "float32", "--transport", "recompute"],
        env=env,
        log_dir=tmp_path / "logs",
    ) as cluster:
        got, transports = generate_all(cluster)
    assert got == [r.token_ids for r in reference]
    assert transports == {"recompute"}


@pytest.mark.gpu
def test_disaggregated_on_tensorrt_llm(model_dir: Path, tmp_path: Path) -> None:
    """TensorRT-LLM itself: disaggregated outputs equal colocated ones (both on its kernels,
    in bfloat16)."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    import tensorrt_llm

    if getattr(tensorrt_llm, "IS_FAKE", False):
        pytest.skip("tensorrt_llm here is the test stand-in, not TensorRT-LLM")
    args = [*WORKER_ARGS, "--dtype", "bfloat16", "--trtllm-kv-fraction", "0.2"]
    runs = {}
    for mode in ("disaggregated", "colocated"):
        with Cluster(
            model_dir,
            mode=mode,
            backend="tensorrt-llm",
            worker_args=args,
            startup_timeout_s=900.0,
            log_dir=tmp_path / mode,
        ) as cluster:
            runs[mode] = generate_all(cluster)
    assert runs["disaggregated"][0] == runs["colocated"][0]
    assert runs["disaggregated"][1] == {"native"}
