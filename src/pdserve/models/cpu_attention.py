"""Native CPU attention: causal prefill and paged decode (``_attention.cpp``).

Why: on CPU, torch's ``scaled_dot_product_attention`` is about half of a long prompt's prefill,
and at decode the per-sequence gathers of KV blocks (``index_select``) plus SDPA are about a
third of a step. These kernels attend flash-attention style (blocked, online softmax, fp32
accumulation; bf16 dot products with ``vdpbf16ps`` where the CPU has AVX512-BF16) and read
the paged cache in place through the block tables: no gather, no padding, no mask tensors.

The module is optional. The import below picks the AVX512-BF16 build on a CPU that has the
feature, else the AVX2 build, else the portable one; with none built (no compiler at install
time) ``kernels_for`` gives ``NONE`` and the model keeps torch's path, which CUDA always uses.
Prefill uses the kernels only in the AVX512-BF16 build (see ``_PREFILL_BUILDS``). The kernels
run on torch's OpenMP threads (``torch.get_num_threads()`` of them; see
``_attention_common.h``) with the GIL released.

Shapes (``nh`` query heads, ``kvh`` KV heads, ``hd`` head dim; query head ``h`` reads KV
head ``h // (nh // kvh)``, as in HF):

- ``prefill(q [n, nh, hd], k/v [ctx, kvh, hd])``: query ``i`` is position ``ctx - n + i`` and
  sees keys ``0 .. ctx - n + i``. ``prefill_paged`` reads the ctx keys from the cache.
- ``decode(q [D, nh, hd], caches [num_blocks, block_size, kvh, hd], block_tables, table_starts
  [D], context_lens [D])``: sequence ``s`` attends its first ``context_lens[s]`` cached tokens,
  in the blocks listed from ``block_tables[table_starts[s]]`` on.

Returns ``[n or D, nh, hd]`` in q's dtype.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

from pdserve.cpuinfo import cpu_flags
from pdserve.errors import InvalidArgumentError

_BF16_DOT_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
_AVX2_FLAGS = frozenset({"avx2", "fma"})
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 512
MAX_GROUP = 64
"""Query heads per KV head at most (a prefill work item holds at least one position's)."""


def _load() -> ModuleType | None:
    flags = cpu_flags()
    names = ["_attention"]
    if flags >= _AVX2_FLAGS:
        names.insert(0, "_attention_avx2")
    if flags >= _BF16_DOT_FLAGS:
        names.insert(0, "_attention_avx512bf16")
    for name in names:
        try:
            return importlib.import_module(f"pdserve.models.{name}")
        except ImportError:
            continue
    return None


_native = _load()
NATIVE_MODULE = _native.__name__.rpartition(".")[2] if _native is not None else ""
"""The build in use (``_attention_avx512bf16``, ``_attention_avx2`` or ``_attention``), or ""
when none loaded."""


@dataclass(frozen=True, slots=True)
class NativeAttention:
    """Which passes attend with the native kernels (the others keep torch's SDPA)."""

    prefill: bool
    decode: bool


NONE = NativeAttention(prefill=False, decode=False)

_PREFILL_BUILDS = frozenset({"_attention_avx512bf16"})
"""Builds whose prefill beat torch's SDPA where measured (docs/benchmarks.md, "Attention
kernels"); the portable and AVX2 builds' prefill (fp32 arithmetic) was not faster, so there
prefill stays on torch. Decode (memory-bound, no gather) is faster in every build."""


def kernels_for(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> NativeAttention:
    """The passes the kernels take for a model of this geometry on ``device`` in ``dtype``."""
    fits = (
        _native is not None
        and device.type == "cpu"
        and dtype in _DTYPE_CODES
        and num_kv_heads >= 1
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim % 2 == 0
        and 0 < head_dim <= MAX_HEAD_DIM
    )
    if not fits:
        return NONE
    return NativeAttention(prefill=NATIVE_MODULE in _PREFILL_BUILDS, decode=True)


def bf16_dot_head_dims() -> frozenset[int]:
    """Head dims whose bf16 kernels use AVX512-BF16 dot products (empty: portable only)."""
    return frozenset(_native.bf16_dot_head_dims()) if _native is not None else frozenset()


def _module() -> ModuleType:
    if _native is None:
        raise RuntimeError("the native attention kernels are not built")
    return _native


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype, heads: int, hd: int) -> None:
    """``t`` is ``[rows, heads, hd]`` on CPU with unit element and ``hd`` head strides."""
    if t.device.type != "cpu" or t.dtype != dtype:
        raise InvalidArgumentError(name, f"must be a CPU {dtype} tensor, got {t.dtype} {t.device}")
    if t.dim() != 3 or t.shape[1] != heads or t.shape[2] != hd:
        raise InvalidArgumentError(name, f"must be [rows, {heads}, {hd}], got {list(t.shape)}")
    if t.stride(2) != 1 or t.stride(1) != hd:
        raise InvalidArgumentError(name, f"needs rows of contiguous heads, strides {t.stride()}")


def _check_cache(name: str, t: torch.Tensor, dtype: torch.dtype, kvh: int, hd: int) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise InvalidArgumentError(name, f"must be a contiguous CPU {dtype} tensor")
    if t.dim() != 4 or t.shape[2] != kvh or t.shape[3] != hd:
        raise InvalidArgumentError(
            name, f"must be [num_blocks, block_size, {kvh}, {hd}], got {list(t.shape)}"
        )


def _check_index(name: str, t: torch.Tensor, dims: int) -> None:
    if t.device.type != "cpu" or t.dtype != torch.int64 or t.dim() != dims:
        raise InvalidArgumentError(name, f"must be a {dims}-D CPU int64 tensor")
    if t.stride(-1) != 1:
        raise InvalidArgumentError(name, "needs unit stride along its last dim")


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype)
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise InvalidArgumentError("out", f"must be a contiguous {q.dtype} tensor {list(q.shape)}")
    return out


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [n, nh, hd]`` over ``k``, ``v`` ``[ctx, kvh, hd]`` (ctx >= n).

    Rows of q, k and v may be strided (views into a fused qkv projection)."""
    n, nh, hd = q.shape
    ctx, kvh = k.shape[0], k.shape[1]
    _check_rows("q", q, q.dtype, nh, hd)
    _check_rows("k", k, q.dtype, kvh, hd)
    _check_rows("v", v, q.dtype, kvh, hd)
    if v.shape[0] != ctx:
        raise InvalidArgumentError("v", f"must have {ctx} rows like k, got {v.shape[0]}")
    out = _output(q, out)
    _module().prefill(
        out.data_ptr(), q.data_ptr(), q.stride(0),
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        0, 1, 0, 0,
        n, ctx, nh, kvh, hd, scale, _DTYPE_CODES[q.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return out


def prefill_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [n, nh, hd]`` (the last n of ``context_len`` positions) over the
    cached keys ``0 .. context_len - 1``, read in place through ``block_table [num_blocks]``."""
    n, nh, hd = q.shape
    kvh = k_cache.shape[2]
    _check_rows("q", q, q.dtype, nh, hd)
    _check_cache("k_cache", k_cache, q.dtype, kvh, hd)
    _check_cache("v_cache", v_cache, q.dtype, kvh, hd)
    if v_cache.shape != k_cache.shape:
        raise InvalidArgumentError("v_cache", "must have k_cache's shape")
    _check_index("block_table", block_table, 1)
    num_blocks, bs = k_cache.shape[0], k_cache.shape[1]
    if block_table.shape[0] * bs < context_len:
        raise InvalidArgumentError("block_table", f"too short for {context_len} tokens")
    out = _output(q, out)
    _module().prefill(
        out.data_ptr(), q.data_ptr(), q.stride(0),
        k_cache.data_ptr(), kvh * hd, v_cache.data_ptr(), kvh * hd,
        block_table.data_ptr(), bs, bs * kvh * hd, num_blocks,
        n, context_len, nh, kvh, hd, scale, _DTYPE_CODES[q.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return out


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    table_starts: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence, ``q [D, nh, hd]``, over its paged context; see the module doc.

    ``block_tables`` int64: the sequences' block tables one after another (no padding);
    sequence ``s``'s starts at ``table_starts[s]`` and covers ``context_lens[s]`` tokens."""
    D, nh, hd = q.shape
    kvh = k_cache.shape[2]
    _check_rows("q", q, q.dtype, nh, hd)
    _check_cache("k_cache", k_cache, q.dtype, kvh, hd)
    _check_cache("v_cache", v_cache, q.dtype, kvh, hd)
    if v_cache.shape != k_cache.shape:
        raise InvalidArgumentError("v_cache", "must have k_cache's shape")
    _check_index("block_tables", block_tables, 1)
    _check_index("table_starts", table_starts, 1)
    _check_index("context_lens", context_lens, 1)
    if table_starts.shape[0] != D or context_lens.shape[0] != D:
        raise InvalidArgumentError("context_lens", f"need {D} entries, one per query")
    out = _output(q, out)
    _module().decode(
        out.data_ptr(), q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.shape[1], k_cache.shape[0],
        block_tables.data_ptr(), block_tables.shape[0], table_starts.data_ptr(),
        context_lens.data_ptr(),
        D, nh, kvh, hd, scale, _DTYPE_CODES[q.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return out
