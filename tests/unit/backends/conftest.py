"""Backends under test: the torch backend, the tensorrt-llm backend on the stand-in
``tensorrt_llm`` (tests/fakes), put on ``sys.path`` only while a test runs, and the sim
backend (pdserve's engine with modelled step times)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TypeVar

import pytest

from pdserve.backends import EngineBackend
from pdserve.engine.engine import Engine
from pdserve.sim.backend import SimOptions, sim_backend, sim_compute

FAKES = Path(__file__).resolve().parents[2] / "fakes"
T = TypeVar("T")


def run(body: Callable[[], Awaitable[T]], timeout_s: float = 120.0) -> T:
    return asyncio.run(asyncio.wait_for(body(), timeout=timeout_s))  # type: ignore[arg-type]


def _drop_tensorrt_llm() -> dict[str, object]:
    gone = {
        k: v for k, v in sys.modules.items() if k == "tensorrt_llm" or k.startswith("tensorrt_llm.")
    }
    for name in gone:
        del sys.modules[name]
    return gone


@pytest.fixture
def fake_tensorrt_llm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The stand-in ``tensorrt_llm`` importable (whatever else is installed); yields the
    directory its context-only requests leave KV in."""
    saved = _drop_tensorrt_llm()
    kv_dir = tmp_path / "fake-trtllm-kv"
    monkeypatch.setenv("FAKE_TENSORRT_LLM_KV_DIR", str(kv_dir))
    monkeypatch.syspath_prepend(str(FAKES))
    import tensorrt_llm

    assert getattr(tensorrt_llm, "IS_FAKE", False), "the stand-in must shadow any real package"
    try:
        yield kv_dir
    finally:
        _drop_tensorrt_llm()
        sys.modules.update(saved)  # type: ignore[arg-type]


EXACT = ("torch", "tensorrt-llm")
"""Backends that compute exactly as pdserve's engine in float32 (the stand-in does)."""


def sim_options(model_dir: Path) -> SimOptions:
    """A sim backend modelling the checkpoint's own shape on an H100, in real time."""
    return SimOptions.parse(f"roofline:h100:{model_dir / 'config.json'}")


def reference_engine(kind: str, model_dir: Path) -> Engine:
    """The engine a backend of ``kind`` drives, run alone (no loop, no backend)."""
    if kind == "sim":
        return Engine.from_pretrained(
            model_dir, compute=sim_compute(sim_options(model_dir)), num_kv_blocks=256
        )
    return Engine.from_pretrained(model_dir, dtype="float32")


@pytest.fixture(params=["torch", "tensorrt-llm", "sim"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    """Each backend the contract runs against; tensorrt-llm on the stand-in."""
    kind: str = request.param
    if kind == "tensorrt-llm":
        request.getfixturevalue("fake_tensorrt_llm")
    return kind


def open_backend(
    kind: str, model_dir: Path, **overrides: object
) -> AbstractAsyncContextManager[EngineBackend]:
    """Build, start and (on exit) close a backend of ``kind`` on ``model_dir`` in float32."""

    @asynccontextmanager
    async def opened() -> AsyncIterator[EngineBackend]:
        backend: EngineBackend
        if kind == "torch":
            from pdserve.backends.pytorch import TorchBackend

            config: dict[str, object] = {"dtype": "float32", "num_kv_blocks": 256, **overrides}
            backend = TorchBackend.from_pretrained(model_dir, **config)
        elif kind == "sim":
            sim: dict[str, object] = {"num_kv_blocks": 256, **overrides}
            backend = sim_backend(model_dir, sim_options(model_dir), **sim)
        else:
            from pdserve.backends.tensorrt_llm import TensorRTLLMBackend
            from pdserve.backends.tensorrt_llm_api import TensorRTLLMConfig

            trt = TensorRTLLMConfig(dtype="float32", stats_interval_s=0.02, **overrides)  # type: ignore[arg-type]
            backend = TensorRTLLMBackend.from_pretrained(model_dir, trt)
        try:
            await backend.start()
            yield backend
        finally:
            await backend.close()

    return opened()
