"""The parameter classes of the stand-in, keyword-only and strict like the real ones (an
unknown argument is a ``TypeError``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REQUEST_TYPES = ("context_only", "generation_only", "context_and_generation")
TRANSCEIVER_BACKENDS = ("DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI")


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [self.json, self.regex, self.grammar, self.json_object, self.structural_tag]
        if sum(bool(g) for g in given) > 1:
            raise ValueError("Only one guide can be used for a request")


@dataclass(kw_only=True)
class SamplingParams:
    max_tokens: int = 32
    end_id: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    detokenize: bool = True
    n: int = 1
    min_tokens: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    prompt_ignore_length: int | None = None
    bad: str | list[str] | None = None
    bad_token_ids: list[int] | None = None
    embedding_bias: Any = None
    """A float32 tensor ``[vocab_size]`` (TensorRT-LLM's documented type)."""
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.n != 1:
            raise ValueError("the stand-in computes one sequence per request")


@dataclass(slots=True, kw_only=True)
class DisaggregatedParams:
    request_type: str | None = None
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None


@dataclass(kw_only=True)
class KvCacheConfig:
    free_gpu_memory_fraction: float | None = None
    max_tokens: int | None = None
    enable_block_reuse: bool = True
    tokens_per_block: int = 32
    event_buffer_max_size: int = 0


@dataclass(kw_only=True)
class CacheTransceiverConfig:
    backend: str | None = None
    max_tokens_in_buffer: int | None = None
    kv_transfer_timeout_ms: int | None = 60000

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in TRANSCEIVER_BACKENDS:
            raise ValueError(f"backend must be one of {TRANSCEIVER_BACKENDS}, got {self.backend!r}")
