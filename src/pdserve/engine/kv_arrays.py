"""The KV as the transports move it: numpy arrays, one dtype per layout dtype, no torch.

A layer's K (or V) of a hand-off is ``[num_tokens, kv_heads, head_dim]``. Between workers it is
bytes with a dtype and a shape: the transports (shm, stream frames, the KV store, fake) write
and read numpy arrays, so a process that never computes with the KV (a simulated worker)
needs no torch to move it. bfloat16 has no numpy dtype: its arrays hold the raw 2-byte words
as ``uint16`` (``WIRE_DTYPES``), and the torch engine views them back as bfloat16 at its own
edge (``kv_tensors.as_tensor``, no copy).

What a sender is given (``KVArray``) may also be a torch tensor: the torch engine's layer
hooks hand out its gathered K and V as they are, so that a CPU tensor reaches shm or a frame
without a copy and a device tensor is copied once, straight into its destination. Every
function here takes either; a tensor is handed to ``kv_tensors`` (torch is loaded already in a
process that has a tensor, so that import costs nothing, and a numpy array never reaches it).
Everything a transport receives is numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

    KVArray: TypeAlias = np.ndarray | torch.Tensor
    """One layer's K or V: numpy in the wire dtype, or (from the torch engine) a tensor."""

WIRE_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype(np.uint16),  # raw bfloat16 words: numpy has no bfloat16
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
}
"""Layout dtype name -> the numpy dtype its KV travels in (its item size is the layout's)."""

_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}


def _torch_edge() -> ModuleType:
    """``kv_tensors``, for an argument that is a tensor: torch is loaded already then (module
    doc), and a numpy argument never comes here."""
    from pdserve.engine import kv_tensors

    return kv_tensors


def host_array(a: KVArray) -> np.ndarray:
    """``a`` as a numpy array in its wire dtype, on the host: itself when numpy; a tensor's
    CPU memory viewed without a copy (any strides), a device tensor's copied to the host."""
    if isinstance(a, np.ndarray):
        return a
    return _torch_edge().host_array(a)


def host_view(a: KVArray) -> np.ndarray | None:
    """``a``'s memory as a numpy array without a copy (any strides); None for a tensor on a
    device (its copy to the host is the caller's: ``kv_tensors.copy_into``)."""
    if isinstance(a, np.ndarray):
        return a
    return _torch_edge().host_view(a)


def contiguous(a: KVArray) -> np.ndarray:
    """``a`` as a C-contiguous host array: itself when it is one already, else one copy
    (a gather from a strided view, or device-to-host)."""
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a)
    return _torch_edge().contiguous(a)


def host_copy(a: KVArray) -> np.ndarray:
    """A private host copy of ``a`` (one copy, device-to-host for a device tensor)."""
    if isinstance(a, np.ndarray):
        return a.copy()
    return _torch_edge().host_copy(a)


def byte_view(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without copying."""
    return a.reshape(-1).view(np.uint8).data


def dtype_name(a: KVArray) -> str:
    """The layout dtype name of ``a`` (``bfloat16`` for a ``uint16`` array: ``WIRE_DTYPES``);
    another array's own dtype name."""
    if isinstance(a, np.ndarray):
        return _NAMES.get(a.dtype, str(a.dtype))
    return str(a.dtype).removeprefix("torch.")


def concat(parts: Sequence[KVArray]) -> np.ndarray:
    """The arrays joined along their first (token) axis, as one new host array."""
    return np.concatenate([host_array(p) for p in parts])


def from_buffer(
    data: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...]
) -> np.ndarray:
    """A view of ``shape`` in ``dtype``'s wire dtype over ``data`` (which it keeps alive)."""
    return np.frombuffer(data, dtype=WIRE_DTYPES[dtype]).reshape(shape)


def to_float32(a: np.ndarray) -> np.ndarray:
    """A wire array's values as float32 (bfloat16 words widened exactly)."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def from_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values in ``dtype``'s wire dtype: bfloat16 rounded to nearest, ties to even,
    as torch rounds it (NaN stays NaN)."""
    if dtype != "bfloat16":
        return x.astype(WIRE_DTYPES[dtype])
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # quiet, sign kept
    return rounded
