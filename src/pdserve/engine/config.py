"""Engine configuration: one validated, documented dataclass read in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdserve.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine lays out memory and batches work.

    Any field can be passed to ``Engine.from_pretrained(path, **fields)``.
    """

    dtype: Literal["bfloat16", "float32", "auto"] = "auto"
    """Compute and KV dtype. ``auto``: bfloat16 where the device has fast bf16 matmuls (GPUs;
    CPUs with AVX512-BF16, AMX or AVX-NE-CONVERT), else float32 (``resolve_dtype``). float16
    is refused on CPU, where it has no fast kernel."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` / ``cuda:N``; the same code runs on both."""
    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """KV blocks in the pool; ``None`` sizes it from ``kv_cache_bytes``."""
    kv_cache_bytes: int = 512 * 1024 * 1024
    """KV pool size in bytes when ``num_kv_blocks`` is not given."""
    max_num_seqs: int = 64
    """Sequences in the running batch at most."""
    max_num_batched_tokens: int = 2048
    """Per-step token budget shared by decode tokens and prefill chunks."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    enable_prefix_caching: bool = True
    """Reuse full KV blocks whose chained hash (every earlier token too) matches."""
    max_model_len: int | None = None
    """Prompt + output tokens at most; defaults to the model's max_position_embeddings."""
    num_threads: int | None = None
    """CPU threads for torch; ``None`` leaves torch's default."""
    return_logits: bool = False
    """Attach each sampled step's full logits to the outputs (for parity tests and debugging)."""
    waiting_order: Literal["fcfs", "short_first"] = "fcfs"
    """Which waiting prompt is admitted next: ``fcfs``, in arrival order; ``short_first``, the
    one with the fewest tokens left to compute, each prompt's count lowered by
    ``aging_tokens_per_s`` for every second it has waited, so that short prompts pass long ones
    without starving them (a long prompt waits at most about its length over the aging rate
    more than under ``fcfs``)."""
    aging_tokens_per_s: float = 2000.0
    prepack_weights: bool = True
    """CPU: prepack the matmul weights into oneDNN's blocked layout at load time (about 1.8x
    faster decode matmuls; the plain weights are then freed). Ignored on CUDA."""
    attention_kernels: bool = True
    """CPU: attend with the native kernels (``pdserve.models.cpu_attention``: flash-style
    prefill, decode over the paged blocks in place) where they are built and fit the model;
    False keeps torch's ``scaled_dot_product_attention`` (for A/B runs and tests). Ignored on
    CUDA, which always uses torch's."""
    guide_cache_bytes: int = 64 * 1024 * 1024
    """Compiled structured-output grammars kept for reuse (``engine.guided``), in bytes of
    the grammar library's own measure; the least recently used go first."""

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float32", "auto"):
            raise InvalidArgumentError(
                "dtype", f"must be bfloat16, float32 or auto, got {self.dtype!r}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise InvalidArgumentError("device", f"must be cpu or cuda[:N], got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidArgumentError(
                "block_size", f"must be a power of two, got {self.block_size}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise InvalidArgumentError("num_kv_blocks", f"must be >= 2, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise InvalidArgumentError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidArgumentError(
                "max_num_batched_tokens",
                f"must be >= max_num_seqs ({self.max_num_seqs}), got {self.max_num_batched_tokens}",
            )
        if self.waiting_order not in ("fcfs", "short_first"):
            raise InvalidArgumentError(
                "waiting_order", f"must be fcfs or short_first, got {self.waiting_order!r}"
            )
        if not self.aging_tokens_per_s > 0:
            raise InvalidArgumentError(
                "aging_tokens_per_s", f"must be > 0, got {self.aging_tokens_per_s}"
            )
        if self.guide_cache_bytes < 0:
            raise InvalidArgumentError(
                "guide_cache_bytes", f"must be >= 0, got {self.guide_cache_bytes}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidArgumentError("max_model_len", f"must be >= 2, got {self.max_model_len}")
