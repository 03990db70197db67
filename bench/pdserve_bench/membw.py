"""The machine's memory bandwidth and the batch-1 decode roofline it implies.

Decode at batch 1 reads every weight once per token (plus the KV of the context) and does
~2 FLOPs per weight, so on a CPU it is bound by memory bandwidth, not arithmetic: the best
possible rate is ``bandwidth / bytes read per token``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.errors import InvalidArgumentError
from pdserve.models.config import ModelConfig

DEFAULT_BYTES = 512 * 1024 * 1024
"""Far above any per-core cache, so the loops stream from DRAM (or the shared L3, if huge)."""


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """Medians over repeats, in GB/s (10^9 bytes per second)."""

    copy_gbps: float
    """``dst.copy_(src)``, counting the bytes read plus the bytes written (2x the size)."""
    read_gbps: float
    """``src.sum()`` over float32: a read-only stream, the access pattern of weight loading."""
    size_bytes: int
    threads: int

    def to_json(self) -> dict[str, float | int]:
        return asdict(self)


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # first touch: page faults and allocation, not bandwidth
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_bandwidth(
    size_bytes: int = DEFAULT_BYTES, threads: int = 2, repeats: int = 5
) -> Bandwidth:
    """Time a copy and a read-only reduction of a ``size_bytes`` tensor with ``threads`` threads."""
    if size_bytes < 4096:
        raise InvalidArgumentError("size_bytes", f"must be >= 4096, got {size_bytes}")
    if repeats < 1:
        raise InvalidArgumentError("repeats", f"must be >= 1, got {repeats}")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(size_bytes // 4, dtype=torch.float32)  # [size / 4] float32
        dst = torch.empty_like(src)
        n = src.numel() * 4
        copy_s = _median_seconds(lambda: dst.copy_(src), repeats)
        read_s = _median_seconds(src.sum, repeats)
    finally:
        torch.set_num_threads(saved)
    return Bandwidth(2 * n / copy_s / 1e9, n / read_s / 1e9, n, threads)


@dataclass(frozen=True, slots=True)
class Roofline:
    """Batch-1 decode bound: ``bandwidth / (weight bytes read + KV bytes read) per token``."""

    weight_bytes_read: int
    """Bytes of weights one decode step reads: every tensor, except that the embedding table
    contributes one row (a lookup), unless it is tied to the LM head (then it is read whole)."""
    weight_bytes_total: int
    """All weights, embedding table included (the looser "whole checkpoint" count)."""
    kv_bytes_per_token: int
    """K and V of one context token across all layers."""
    mean_context: float
    """Mean context length over the measured decode steps."""
    bandwidth_gbps: float

    @property
    def bytes_per_token(self) -> float:
        return self.weight_bytes_read + self.kv_bytes_per_token * self.mean_context

    @property
    def tokens_per_second(self) -> float:
        return self.bandwidth_gbps * 1e9 / self.bytes_per_token

    def to_json(self) -> dict[str, float | int]:
        return {
            **asdict(self),
            "bytes_per_token": self.bytes_per_token,
            "tokens_per_second": self.tokens_per_second,
        }


def checkpoint_param_counts(model_dir: str | Path) -> dict[str, int]:
    """Tensor name -> element count, read from the safetensors headers (no data loaded)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InvalidArgumentError("model", f"no *.safetensors files in {model_dir}")
    counts: dict[str, int] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open handles are not iterable
                shape = st.get_slice(name).get_shape()
                counts[name] = int(torch.Size(shape).numel())
    return counts


def decode_roofline(
    model_dir: str | Path, bandwidth_gbps: float, mean_context: float, dtype_bytes: int = 2
) -> Roofline:
    """The batch-1 decode roofline for a checkpoint held in a ``dtype_bytes``-wide dtype."""
    cfg = ModelConfig.from_dir(Path(model_dir))
    counts = checkpoint_param_counts(model_dir)
    total = sum(counts.values())
    read = total
    embed = counts.get("model.embed_tokens.weight")
    if embed is not None and not cfg.tie_word_embeddings:
        read = total - embed + cfg.hidden_size
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    return Roofline(read * dtype_bytes, total * dtype_bytes, kv, mean_context, bandwidth_gbps)
