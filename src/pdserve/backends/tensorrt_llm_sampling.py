"""TensorRT-LLM's sampling parameters for a pdserve request (``sampling_params``): the
translation of pdserve's ``SamplingParams``, logits controls and structured-output guide onto
``tensorrt_llm.SamplingParams`` and ``tensorrt_llm.llmapi.GuidedDecodingParams``, and the
refusal, naming the field, of what TensorRT-LLM cannot honour (``unsupported``).
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.backends.tensorrt_llm_api import LLMApi
from pdserve.engine.guide import JSON_OBJECT_SCHEMA, Guide, GuideKind
from pdserve.engine.guided import check_syntax
from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import InvalidArgumentError


def sampling_params(
    api: LLMApi,
    params: SamplingParams,
    *,
    prompt_len: int,
    vocab_size: int,
    max_tokens: int | None = None,
) -> Any:
    """TensorRT-LLM's sampling parameters for ``params`` (``max_tokens`` overrides its own).

    Greedy is ``top_k=1`` (TensorRT-LLM's own spelling of it); one logprob per token is asked
    for, the sampled token's. The logits controls map to their namesakes (``logit_bias`` to
    ``embedding_bias``, one-token bad words to ``bad_token_ids``); ``prompt_ignore_length``
    keeps the prompt's ``prompt_len`` tokens out of the presence and frequency penalties, which
    count the output only in pdserve. A guide becomes ``guided_decoding`` (``guided``), its
    syntax checked here first. What TensorRT-LLM cannot honour is refused
    (``InvalidArgumentError`` naming the field): see ``unsupported``.
    """
    why = unsupported(params)
    if why is not None:
        raise InvalidArgumentError(*why)
    if params.guide is not None:
        check_syntax(params.guide, prefix="sampling.")
    kwargs: dict[str, Any] = {
        "max_tokens": params.max_tokens if max_tokens is None else max_tokens,
        "ignore_eos": params.ignore_eos,
        "logprobs": 1,
    }
    if params.stop_token_ids:
        kwargs["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        kwargs["stop"] = list(params.stop)
    if params.seed is not None:
        kwargs["seed"] = params.seed
    if params.greedy:
        kwargs["top_k"] = 1
    else:
        kwargs["temperature"] = params.temperature
        if params.top_k:
            kwargs["top_k"] = params.top_k
        if params.top_p < 1.0:
            kwargs["top_p"] = params.top_p
        if params.min_p:
            kwargs["min_p"] = params.min_p
    kwargs.update(_controls(params, prompt_len, vocab_size))
    if params.guide is not None:
        kwargs["guided_decoding"] = guided(api, params.guide)
    return api.SamplingParams(**kwargs)


def guided(api: LLMApi, guide: Guide) -> Any:
    """TensorRT-LLM's ``GuidedDecodingParams`` of ``guide``: a schema, a regex and a grammar
    map to their namesakes; a choice to the grammar of its strings; a JSON object to the
    schema of any object (TensorRT-LLM's own ``json_object`` also allows an array, pdserve's
    does not)."""
    if guide.kind is GuideKind.JSON:
        return api.GuidedDecodingParams(json=guide.spec)
    if guide.kind is GuideKind.JSON_OBJECT:
        return api.GuidedDecodingParams(json=JSON_OBJECT_SCHEMA)
    if guide.kind is GuideKind.REGEX:
        return api.GuidedDecodingParams(regex=guide.spec)
    if guide.kind is GuideKind.CHOICE:
        return api.GuidedDecodingParams(grammar=guide.ebnf())
    return api.GuidedDecodingParams(grammar=guide.spec)


def unsupported(params: SamplingParams) -> tuple[str, str] | None:
    """(field, why) of a control TensorRT-LLM's ``SamplingParams`` cannot express; None when
    it can express them all."""
    if params.allowed_token_ids:
        return "sampling.allowed_token_ids", "tensorrt-llm has no allowed-token list"
    if params.bad_words:
        return "sampling.bad_words", "give the words as token ids (the router tokenizes them)"
    if any(len(w) > 1 for w in params.bad_words_token_ids):
        return (
            "sampling.bad_words_token_ids",
            "tensorrt-llm takes bad words of one token only (bad_token_ids)",
        )
    if params.logprobs:
        return "sampling.logprobs", "the tensorrt-llm backend reports the sampled token's only"
    if params.prompt_logprobs is not None:
        return "sampling.prompt_logprobs", "the tensorrt-llm backend computes no prompt logprobs"
    if params.min_tokens and (params.stop_token_ids or params.stop):
        # TensorRT-LLM's min_tokens holds back the end token alone: its stop words still end
        # the request early.
        return (
            "sampling.min_tokens",
            "tensorrt-llm applies min_tokens to the end-of-sequence token only, not to "
            "stop_token_ids or stop strings",
        )
    return None


def _controls(params: SamplingParams, prompt_len: int, vocab_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if params.presence_penalty or params.frequency_penalty:
        out["presence_penalty"] = params.presence_penalty
        out["frequency_penalty"] = params.frequency_penalty
        out["prompt_ignore_length"] = prompt_len
    if params.repetition_penalty != 1.0:
        out["repetition_penalty"] = params.repetition_penalty
    if params.min_tokens:
        out["min_tokens"] = params.min_tokens
    if params.bad_words_token_ids:
        out["bad_token_ids"] = [w[0] for w in params.bad_words_token_ids]
    if params.logit_bias:
        bias = torch.zeros(vocab_size, dtype=torch.float32)
        for token, value in params.logit_bias.items():
            bias[token] = value
        out["embedding_bias"] = bias
    return out


def continued_guide(guide: Guide) -> InvalidArgumentError:
    """The refusal of a guided request continued from tokens drawn elsewhere (a recompute
    hand-off, a migration): they would join the prompt of a new TensorRT-LLM request, whose
    grammar would start over at them."""
    return InvalidArgumentError(
        f"sampling.{guide.kind.field}",
        "tensorrt-llm cannot continue a guided request from tokens drawn elsewhere (a "
        "recompute hand-off or a migration): use the native transport",
    )
