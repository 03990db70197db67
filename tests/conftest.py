"""Shared fixtures: tiny demo checkpoints (made once per session), a Mooncake Store master,
and GPU test skipping."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pdserve.kvstore.mooncake.master import MasterProcess

GPU_SKIP_REASON = "needs a CUDA device (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when gpu tests were collected: keeps plain collection light

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in gpu_items:
        item.add_marker(skip)


def _tiny(tmp_path_factory: pytest.TempPathFactory, name: str, **overrides: object) -> Path:
    from pdserve.models.demo import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp(name), "tiny", dtype="float32", **overrides)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama checkpoint, float32, seed 0, untied."""
    return _tiny(tmp_path_factory, "tiny_llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2 checkpoint (q/k/v biases, rope theta 1e6), float32, seed 0."""
    return _tiny(tmp_path_factory, "tiny_qwen2", family="qwen2")


@pytest.fixture(scope="session")
def tiny_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama checkpoint with tied input/output embeddings (no lm_head.weight)."""
    return _tiny(tmp_path_factory, "tiny_tied", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[MasterProcess]:
    """One ``mooncake_master`` for the session (tests use distinct keys); skips with the reason
    where the Mooncake package cannot load."""
    from pdserve.kvstore.mooncake.library import available
    from pdserve.kvstore.mooncake.master import MasterProcess

    reason = available()
    if reason:
        pytest.skip(reason)
    with MasterProcess() as master:
        yield master
