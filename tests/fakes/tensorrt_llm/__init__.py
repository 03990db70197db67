"""A stand-in for TensorRT-LLM's LLM API (see tests/fakes/README.md); not the real package."""

from tensorrt_llm.llmapi import LLM, SamplingParams

__version__ = "0.0.0+fake"
IS_FAKE = True

__all__ = ["IS_FAKE", "LLM", "SamplingParams"]
