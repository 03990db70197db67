"""A linear layer whose weight can be prepacked for oneDNN on CPU.

Why: on CPU, ``F.linear`` reorders the weight into oneDNN's blocked layout on every call, and
for the matrix-vector products of decode (``M`` = a few rows) that reorder plus the plain-layout
kernel stream the weight at about half the machine's memory bandwidth. Packing once at load time
(what inductor's freezing pass does) and calling the packed kernel measured here at 1.8x the
speed for the 33 matmuls of a small-model decode step (bf16, M=1: 5.1 ms -> 2.8 ms; M=8:
5.5 ms -> 3.4 ms), and faster at every M up to 4096 rows, in bf16 and fp32 alike.

The packed path is CPU-only; on CUDA (or a torch built without oneDNN) the layer stays a plain
``nn.Linear``: same module, same parameter names, same results up to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacking is available for weights of ``dtype`` on ``device``.

    bf16 packing needs the CPU's bf16 instructions (AVX512-BF16/AMX or AVX-NE-CONVERT);
    without them oneDNN refuses to pack, so an AVX2-only machine keeps the plain layer.
    """
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (dtype != torch.bfloat16 or cpu_has_bf16_kernels())
    )


def cpu_has_bf16_kernels() -> bool:
    """Whether oneDNN has bf16 matmul kernels on this CPU (AVX512-BF16, AMX or AVX-NE-CONVERT).

    Without them (an AVX2-only CPU) torch emulates bf16 matmuls, many times slower than fp32
    ones at prefill sizes. False where this torch build has no such probe.
    """
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


class Linear(nn.Linear):
    """``nn.Linear`` plus an optional oneDNN-prepacked copy of its weight (CPU only)."""

    packed: torch.Tensor | None
    """The weight in oneDNN's blocked layout; when set, ``forward`` uses it."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = None

    def prepack(self, *, batch_hint: int = 1, drop_dense: bool = True) -> None:
        """Pack the weight for oneDNN (call once the weights are loaded; see ``can_prepack``).

        ``batch_hint``: the row count oneDNN tunes the layout for (any row count works after).
        ``drop_dense``: free the plain weight, which ``forward`` no longer reads; pass False
        when the tensor is shared with another module (a tied embedding).
        """
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)
        if drop_dense:
            # An empty stand-in keeps the attribute typed; any use of it fails loudly on shape.
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` -> ``[T, out]``."""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
