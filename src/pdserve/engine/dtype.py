"""Which dtype ``dtype="auto"`` means on a device.

bfloat16 halves the bytes every decode step streams (weights and KV), so it is the choice
wherever the device has bf16 matmul kernels. Where it has none, an AVX2-only CPU, torch
emulates bf16 matmuls through fp32 at many times the cost of an fp32 matmul of the same
shape, so float32 is faster there despite moving twice the bytes.
"""

from __future__ import annotations

import torch

from pdserve.models.linear import cpu_has_bf16_kernels


def resolve_dtype(dtype: str, device: str) -> str:
    """``dtype`` itself unless it is ``auto``; then ``bfloat16`` or ``float32`` (module doc)."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_has_bf16_kernels() else "float32"
