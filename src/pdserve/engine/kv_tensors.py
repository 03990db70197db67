"""The torch engine's edge of the KV arrays (``kv_arrays``): tensors to and from numpy.

Imported only where a torch tensor is at hand (the torch engine, its model runner, a sender
given a tensor), never by a process that moves numpy KV alone.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from pdserve.engine.kv_arrays import WIRE_DTYPES

_INT_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT_BY_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def host_view(t: torch.Tensor) -> np.ndarray | None:
    """A CPU tensor's memory as a numpy array in its wire dtype (bfloat16 as ``uint16``
    words; other dtypes numpy knows as themselves), any strides, no copy; None on a device."""
    if t.device.type != "cpu":
        return None
    t = t.detach()
    name = str(t.dtype).removeprefix("torch.")
    if name in WIRE_DTYPES:
        return t.view(_INT_BY_SIZE[t.element_size()]).numpy().view(WIRE_DTYPES[name])
    return t.numpy()


def host_array(t: torch.Tensor) -> np.ndarray:
    """``host_view``, after a copy to the host for a device tensor."""
    view = host_view(t)
    if view is None:
        view = host_view(t.detach().cpu())
        assert view is not None
    return view


def host_copy(t: torch.Tensor) -> np.ndarray:
    """A private host copy of ``t`` (one copy, device-to-host for a device tensor)."""
    return host_array(t.detach().to("cpu", copy=True))


def contiguous(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous host array of ``t``: a view when it is one already, else one copy
    (``copy_`` into an uninitialised tensor: a gather from a strided view, or device-to-host,
    with no zero-filling first)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        out = torch.empty(t.shape, dtype=t.dtype)
        out.copy_(t)
        t = out
    return host_array(t)


def copy_into(dst: np.ndarray, src: torch.Tensor) -> torch.Tensor:
    """A tensor view of ``src``'s dtype and shape over the contiguous uint8 ``dst``, for
    ``Tensor.copy_`` (device-to-host, or on torch's intra-op threads) straight into it."""
    return torch.from_numpy(dst).view(src.dtype).view(src.shape)


def as_tensor(a: np.ndarray | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A received KV array (in ``dtype``'s wire dtype) as a ``dtype`` tensor, without a
    copy (a tensor is returned as it is). Read-only arrays (a received message's bytes) are
    viewed too: nothing writes into a received payload, the engine copies it into its blocks."""
    if isinstance(a, torch.Tensor):
        return a
    ints = a.view(_NP_INT_BY_SIZE[a.itemsize])
    with warnings.catch_warnings():
        # torch cannot mark a tensor read-only, and warns of it.
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        t = torch.from_numpy(ints)
    return t.view(dtype)
