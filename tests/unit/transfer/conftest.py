"""Fixtures of the transfer tests: a small layout, random payloads, a private shm prefix."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.engine.kv_arrays import dtype_name, host_array
from pdserve.engine.kv_payload import KVLayout, KVPayload
from pdserve.transfer.janitor import SHM_DIR


def make_layout(
    dtype: str = "float32", *, num_layers: int = 3, fingerprint: str = "fp-a"
) -> KVLayout:
    return KVLayout(fingerprint, dtype, num_layers, num_kv_heads=2, head_dim=8, block_size=16)


def random_payload(layout: KVLayout, num_tokens: int, seed: int = 0) -> KVPayload:
    g = torch.Generator().manual_seed(seed)
    shape = (num_tokens, layout.num_kv_heads, layout.head_dim)
    dtype = getattr(torch, layout.dtype)
    keys = tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(layout.num_layers))
    values = tuple(torch.randn(shape, generator=g).to(dtype) for _ in range(layout.num_layers))
    return KVPayload(layout, num_tokens, keys, values)


def assert_same_payload(a: KVPayload, b: KVPayload) -> None:
    """Equal layouts and bit-equal arrays (a sent tensor against the numpy array received)."""
    assert a.layout == b.layout and a.num_tokens == b.num_tokens
    for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
        assert dtype_name(x) == dtype_name(y) == a.layout.dtype
        assert np.array_equal(host_array(x), host_array(y))


def leftovers(prefix: str) -> list[str]:
    """Files under ``prefix`` in /dev/shm (segments somebody forgot)."""
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    """A segment prefix of this test alone (other processes may use /dev/shm too)."""
    if not SHM_DIR.is_dir():
        pytest.skip("no /dev/shm on this machine")
    prefix = f"pdserve-kvtest-{uuid.uuid4().hex[:10]}-"
    yield prefix
    for name in leftovers(prefix):  # keep the machine clean even when a test failed
        with contextlib.suppress(FileNotFoundError):
            (Path(SHM_DIR) / name).unlink()
