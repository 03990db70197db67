"""The KV arrays between workers (numpy, bfloat16 as 2-byte words) and the torch engine's
edge: views without copies both ways, and bfloat16 rounding as torch rounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.kv_arrays import (
    concat,
    contiguous,
    dtype_name,
    from_float32,
    host_array,
    host_copy,
    to_float32,
)
from pdserve.engine.kv_tensors import as_tensor


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_a_cpu_tensor_is_viewed_without_a_copy_and_viewed_back(name: str) -> None:
    t = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(0)).to(getattr(torch, name))
    a = host_array(t)
    assert dtype_name(a) == name and a.shape == (5, 2, 8)
    assert a.ctypes.data == t.data_ptr()  # the tensor's memory
    back = as_tensor(a, t.dtype)
    assert back.data_ptr() == t.data_ptr() and torch.equal(back, t)


def test_strided_tensors_are_viewed_and_made_contiguous_once() -> None:
    t = torch.randn(6, 2, 8).bfloat16()[::2]  # every other token: not contiguous
    view = host_array(t)
    assert view.ctypes.data == t.data_ptr() and not view.flags.c_contiguous
    flat = contiguous(t)
    assert flat.flags.c_contiguous and torch.equal(as_tensor(flat, torch.bfloat16), t)
    copy = host_copy(t)
    assert copy.ctypes.data != t.data_ptr() and np.array_equal(copy, view)


def test_concat_joins_tensors_and_arrays_along_tokens() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 2, 2)
    joined = concat([t, np.full((1, 2, 2), -1.0, dtype=np.float32)])
    assert joined.shape == (4, 2, 2) and joined[:3].tolist() == t.tolist()


def test_bfloat16_rounds_to_nearest_even_as_torch_does() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=g) * torch.logspace(-20, 20, 4096)
    # Exact ties (the dropped half is 0x8000) on both sides of even, and the specials.
    ties = torch.from_numpy(
        np.array([0x3F808000, 0x3F818000, 0xBF808000], dtype=np.uint32).view(np.float32)
    )
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    x = torch.cat([x, ties, special])
    words = from_float32(x.numpy(), "bfloat16")
    want = x.to(torch.bfloat16)
    got = as_tensor(words, torch.bfloat16)
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all())
    widened = to_float32(words)  # exact: bfloat16 is float32's top half
    assert torch.equal(torch.from_numpy(widened)[:-1], want.float()[:-1])
