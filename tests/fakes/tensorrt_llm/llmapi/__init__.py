"""``tensorrt_llm.llmapi`` of the stand-in: the classes the pdserve backend uses."""

from tensorrt_llm._fake_llm import LLM, CompletionOutput, Logprob, RequestOutput
from tensorrt_llm._fake_params import (
    CacheTransceiverConfig,
    DisaggregatedParams,
    GuidedDecodingParams,
    KvCacheConfig,
    SamplingParams,
)

__all__ = [
    "LLM",
    "CacheTransceiverConfig",
    "CompletionOutput",
    "DisaggregatedParams",
    "GuidedDecodingParams",
    "KvCacheConfig",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]
