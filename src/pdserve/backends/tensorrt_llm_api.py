"""TensorRT-LLM's LLM API as the tensorrt-llm backend uses it: the lazy import, and the
translations between its objects and pdserve's.

The surface used, all of it documented LLM API: ``tensorrt_llm.LLM`` (constructor,
``generate_async``, ``get_stats_async``, ``shutdown``), ``tensorrt_llm.SamplingParams``,
and ``tensorrt_llm.llmapi.DisaggregatedParams``, ``GuidedDecodingParams``, ``KvCacheConfig``
and ``CacheTransceiverConfig``; on the outputs, ``RequestOutput.outputs``/``finished``/
``aresult()``/``abort()`` and ``CompletionOutput.token_ids``/``logprobs``/``finish_reason``/
``disaggregated_params``. Nothing here imports ``tensorrt_llm`` at module level.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.backends.base import TENSORRT_LLM, NativeKV
from pdserve.engine.kv_payload import DTYPES
from pdserve.engine.outputs import FinishReason
from pdserve.errors import (
    InvalidArgumentError,
    KVTransferError,
    ModelLoadError,
    WorkerUnavailableError,
)

DEFAULT_BLOCK_SIZE = 32
"""TensorRT-LLM's default tokens per KV block (the layout's until the engine reports its own)."""

TRANSCEIVER_BACKENDS = ("DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI")
"""The communication backends of TensorRT-LLM's cache transceiver (``CacheTransceiverConfig``)."""
GUIDED_DECODING_BACKENDS = ("xgrammar", "llguidance")
"""TensorRT-LLM's grammar backends (``LLM(guided_decoding_backend=...)``)."""

MISSING = (
    "the tensorrt-llm backend needs the tensorrt_llm package, which NVIDIA publishes on its "
    "own package index for CUDA machines with Python 3.10 or 3.12"
)

NO_BLOCK_ACCESS = (
    "the tensorrt-llm backend moves KV only through TensorRT-LLM's own cache transceiver "
    "(transport native, both sides tensorrt-llm): its LLM API has no call that reads or "
    "writes KV blocks, so pdserve's transports (store, direct, shm) cannot carry its KV"
)


@dataclass(frozen=True, slots=True)
class LLMApi:
    """The classes of the LLM API the backend uses (the real package, or a stand-in)."""

    LLM: Any
    SamplingParams: Any
    DisaggregatedParams: Any
    GuidedDecodingParams: Any
    KvCacheConfig: Any
    CacheTransceiverConfig: Any


def load_api() -> LLMApi:
    """Import ``tensorrt_llm``; ``WorkerUnavailableError`` saying why when it cannot."""
    try:
        import tensorrt_llm
        from tensorrt_llm import llmapi
    except ImportError as err:
        raise WorkerUnavailableError(f"{MISSING} ({err})") from err
    return LLMApi(
        LLM=tensorrt_llm.LLM,
        SamplingParams=tensorrt_llm.SamplingParams,
        DisaggregatedParams=llmapi.DisaggregatedParams,
        GuidedDecodingParams=llmapi.GuidedDecodingParams,
        KvCacheConfig=llmapi.KvCacheConfig,
        CacheTransceiverConfig=llmapi.CacheTransceiverConfig,
    )


def unavailable() -> str | None:
    """Why the backend cannot run here (None: ``tensorrt_llm`` imports)."""
    try:
        load_api()
    except WorkerUnavailableError as err:
        return str(err)
    return None


@dataclass(frozen=True, slots=True)
class TensorRTLLMConfig:
    """What the backend passes to ``tensorrt_llm.LLM`` (None: TensorRT-LLM's default)."""

    dtype: str = "auto"
    max_model_len: int | None = None
    """``max_seq_len``: prompt plus output tokens at most."""
    max_num_batched_tokens: int | None = None
    """``max_num_tokens``: tokens one iteration computes at most."""
    max_num_seqs: int | None = None
    """``max_batch_size``."""
    block_size: int | None = None
    """``KvCacheConfig.tokens_per_block``."""
    kv_max_tokens: int | None = None
    """``KvCacheConfig.max_tokens``: the KV cache's size in tokens."""
    free_gpu_memory_fraction: float | None = None
    """``KvCacheConfig.free_gpu_memory_fraction``: the KV cache's share of free GPU memory."""
    transceiver: str = "DEFAULT"
    """``CacheTransceiverConfig.backend``: DEFAULT, UCX, NIXL, MPI, ..."""
    transceiver_max_tokens: int | None = None
    """``CacheTransceiverConfig.max_tokens_in_buffer``."""
    stats_interval_s: float = 0.5
    """How often the engine's iteration statistics (capacity) are read."""
    guided_decoding_backend: str = "xgrammar"
    """``LLM(guided_decoding_backend=...)``: the grammar library of structured output."""

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidArgumentError("dtype", f"must be auto or one of {sorted(DTYPES)}")
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidArgumentError(name, f"must be >= 1, got {value}")
        if self.kv_max_tokens is not None and self.kv_max_tokens < 1:
            raise InvalidArgumentError("kv_max_tokens", f"must be >= 1, got {self.kv_max_tokens}")
        fraction = self.free_gpu_memory_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise InvalidArgumentError(
                "free_gpu_memory_fraction", f"must be in (0, 1], got {fraction}"
            )
        if self.transceiver not in TRANSCEIVER_BACKENDS:
            raise InvalidArgumentError("transceiver", f"must be one of {TRANSCEIVER_BACKENDS}")
        if not self.stats_interval_s > 0:
            raise InvalidArgumentError("stats_interval_s", "must be > 0")
        if self.guided_decoding_backend not in GUIDED_DECODING_BACKENDS:
            raise InvalidArgumentError(
                "guided_decoding_backend", f"must be one of {GUIDED_DECODING_BACKENDS}"
            )

    def llm_kwargs(self, api: LLMApi, model_dir: Path) -> dict[str, Any]:
        """The keyword arguments of ``tensorrt_llm.LLM``."""
        kv: dict[str, Any] = {}
        if self.block_size is not None:
            kv["tokens_per_block"] = self.block_size
        if self.kv_max_tokens is not None:
            kv["max_tokens"] = self.kv_max_tokens
        if self.free_gpu_memory_fraction is not None:
            kv["free_gpu_memory_fraction"] = self.free_gpu_memory_fraction
        transceiver: dict[str, Any] = {"backend": self.transceiver}
        if self.transceiver_max_tokens is not None:
            transceiver["max_tokens_in_buffer"] = self.transceiver_max_tokens
        kwargs: dict[str, Any] = {
            "model": str(model_dir),
            "dtype": self.dtype,
            "kv_cache_config": api.KvCacheConfig(**kv),
            "cache_transceiver_config": api.CacheTransceiverConfig(**transceiver),
            "enable_iter_perf_stats": True,  # capacity comes from the iteration statistics
            "guided_decoding_backend": self.guided_decoding_backend,
        }
        limits = {
            "max_seq_len": self.max_model_len,
            "max_num_tokens": self.max_num_batched_tokens,
            "max_batch_size": self.max_num_seqs,
        }
        kwargs.update({k: v for k, v in limits.items() if v is not None})
        return kwargs


# -- the checkpoint -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CheckpointShape:
    """What the backend reads from a Hugging Face ``config.json`` itself."""

    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: str
    """The checkpoint's dtype name (``torch_dtype``, or ``dtype`` in newer configs)."""


def read_shape(model_dir: str | Path) -> CheckpointShape:
    """The shape of the checkpoint in ``model_dir``; ``ModelLoadError`` names what is off."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from err
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return CheckpointShape(
            vocab_size=int(cfg["vocab_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        )
    except KeyError as err:
        raise ModelLoadError(f"{path} is missing the key {err.args[0]!r}") from None


# -- hand-offs ---------------------------------------------------------------------------
def generation_params(api: LLMApi, kv: NativeKV) -> Any:
    """The disaggregated parameters of the generation-only request that continues ``kv``."""
    return api.DisaggregatedParams(
        request_type="generation_only",
        first_gen_tokens=list(kv.first_gen_tokens),
        ctx_request_id=kv.ctx_request_id,
        opaque_state=kv.opaque_state or None,
        draft_tokens=list(kv.draft_tokens) or None,
    )


def native_of(disaggregated: Any) -> NativeKV:
    """The handle of a context-only request's KV, from its output's disaggregated params."""
    ctx_id = getattr(disaggregated, "ctx_request_id", None)
    first = getattr(disaggregated, "first_gen_tokens", None)
    if ctx_id is None or not first:
        raise KVTransferError(
            "tensorrt-llm's context-only output lacks ctx_request_id or first_gen_tokens"
        )
    return NativeKV(
        backend=TENSORRT_LLM,
        ctx_request_id=int(ctx_id),
        first_gen_tokens=tuple(int(t) for t in first),
        opaque_state=bytes(getattr(disaggregated, "opaque_state", None) or b""),
        draft_tokens=tuple(int(t) for t in getattr(disaggregated, "draft_tokens", None) or ()),
    )


# -- outputs ------------------------------------------------------------------------------
_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "cancelled": FinishReason.ABORT,
}


def finish_reason(value: object, request_id: str) -> FinishReason | None:
    """pdserve's finish reason of a ``CompletionOutput.finish_reason`` (None: not finished).

    ``timeout`` (TensorRT-LLM gave up on the request, a KV transfer among the causes) is a
    ``KVTransferError``.
    """
    if value is None:
        return None
    name = str(getattr(value, "value", value)).lower()
    if name == "timeout":
        raise KVTransferError(f"tensorrt-llm timed out on {request_id!r}")
    if name not in _FINISH:
        raise WorkerUnavailableError(f"tensorrt-llm finished {request_id!r} with {value!r}")
    return _FINISH[name]


def new_logprobs(
    entries: Sequence[Any] | None, token_ids: Sequence[int], start: int
) -> list[float]:
    """The logprobs of ``token_ids[start:]``.

    ``entries`` (``CompletionOutput.logprobs``) holds floats or one ``{token: Logprob}`` per
    token, aligned with the *end* of ``token_ids``: a generation-only request may leave out the
    context phase's first token. A token without one gets NaN.
    """
    entries = entries or []
    offset = len(token_ids) - len(entries)
    out: list[float] = []
    for i in range(start, len(token_ids)):
        j = i - offset
        out.append(_logprob(entries[j], token_ids[i]) if 0 <= j < len(entries) else math.nan)
    return out


def _logprob(entry: Any, token: int) -> float:
    if isinstance(entry, Mapping):
        found: Any = entry.get(token)
        if found is None:
            return math.nan
        return float(getattr(found, "logprob", found))
    return float(entry)


@dataclass(frozen=True, slots=True)
class KVStats:
    """The KV cache part of one of TensorRT-LLM's iteration statistics."""

    blocks_total: int
    blocks_free: int
    block_size: int


def kv_stats(stat: Mapping[str, Any] | str) -> KVStats | None:
    """``kvCacheStats`` of one ``get_stats_async`` item (a dict, or its JSON text in older
    releases); None when it has none."""
    if isinstance(stat, str):
        stat = json.loads(stat)
    kv = stat.get("kvCacheStats") if isinstance(stat, Mapping) else None
    if not isinstance(kv, Mapping) or "maxNumBlocks" not in kv:
        return None
    total = int(kv["maxNumBlocks"])
    if "freeNumBlocks" in kv:
        free = int(kv["freeNumBlocks"])
    else:
        free = total - int(kv.get("usedNumBlocks", 0))
    return KVStats(
        blocks_total=total, blocks_free=free, block_size=int(kv.get("tokensPerBlock", 0))
    )
