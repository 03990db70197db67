"""Nothing silently ignored: which request fields the gateway refuses, and the unknown-field
rule.

* ``unknown_fields``: keys that neither OpenAI's nor vLLM's schema has (kept by ``protocol``'s
  models in ``model_extra``), at any depth: ``stream_options.x``, ``messages[0].x``,
  ``messages[0].content[1].x``. The gateway refuses the first with a 400 naming it, unless it
  runs with ``--allow-unknown-fields`` (some clients send keys of their own): then they are
  ignored.
* ``refusals``: (field, why) of each known field set to something pdserve does not do (beam
  search, the deprecated ``functions``, multimodal input, ...). Its default, or a value that
  means the same, is taken. (``tools``, ``tool_choice`` and ``parallel_tool_calls`` are
  checked by ``tools``.)

``docs/http-api.md`` lists every field and what becomes of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pdserve.gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from pdserve.logprobs import MAX_LOGPROBS

NOT_YET = "is not supported yet"
NO_EFFECT = ("user", "safety_identifier", "prompt_cache_key", "include_reasoning")
"""Fields taken with any value of their type that change nothing, by their definition here:
identifiers for the caller's own records (``user``, ``safety_identifier``), a hint for
OpenAI's cache routing that pdserve's prefix caches do not need (``prompt_cache_key``), and
the switch of a reasoning parser pdserve does not run (``include_reasoning``)."""


def unknown_fields(body: BaseModel, path: str = "") -> list[tuple[str, str]]:
    """(where, key) of each key ``body`` and the objects in it hold outside their schema;
    ``where`` is the path of the object holding it ("" for the body)."""
    found = [(path, key) for key in body.model_extra or {}]
    for name in type(body).model_fields:
        value = getattr(body, name)
        here = f"{path}.{name}" if path else name
        if isinstance(value, BaseModel):
            found += unknown_fields(value, here)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    found += unknown_fields(item, f"{here}[{i}]")
    return found


@dataclass(frozen=True, slots=True)
class Refusal:
    """``field`` is refused when ``applies(body)``, because ``why``."""

    field: str
    applies: Callable[[Any], bool]
    why: str


def _set(name: str) -> Callable[[Any], bool]:
    """Set at all (``null`` and ``false`` are unset)."""
    return lambda body: getattr(body, name) not in (None, False)


def _nonempty(name: str) -> Callable[[Any], bool]:
    """Non-empty (an empty list or string asks for nothing)."""
    return lambda body: bool(getattr(body, name))


_GUIDED = (
    "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern",
    "structured_outputs",
)  # fmt: skip
"""vLLM's guided-decoding fields pdserve does not take (guided_json, guided_regex,
guided_choice and guided_grammar it honours: ``prepare._guided``)."""

SHARED: tuple[Refusal, ...] = (
    Refusal("best_of", lambda b: b.best_of is not None and b.best_of > 1,
            "best_of > 1 is not supported; use n"),
    Refusal("use_beam_search", _set("use_beam_search"), "beam search is not supported"),
    Refusal("length_penalty", lambda b: b.length_penalty != 1.0,
            "applies to beam search, which is not supported"),
    Refusal("include_stop_str_in_output", _set("include_stop_str_in_output"),
            "the text always ends before the stop string"),
    Refusal("spaces_between_special_tokens", lambda b: not b.spaces_between_special_tokens,
            "special tokens are always decoded with the tokenizer's spacing"),
    Refusal("allowed_token_ids", lambda b: b.allowed_token_ids == [],
            "must hold at least one token id"),
    Refusal("prompt_logprobs", lambda b: b.prompt_logprobs is not None and b.stream,
            "prompt logprobs are not available with stream: true"),
    Refusal("prompt_logprobs",
            lambda b: b.prompt_logprobs is not None and b.prompt_logprobs > MAX_LOGPROBS,
            f"at most {MAX_LOGPROBS}"),
    *(Refusal(name, _set(name), f"guided decoding {NOT_YET}") for name in _GUIDED),
    Refusal("priority", lambda b: b.priority != 0, "priority scheduling is not supported"),
    Refusal("logits_processors", _set("logits_processors"),
            "custom logits processors are not supported"),
    Refusal("cache_salt", _set("cache_salt"),
            "prefix caches are salted by the API key's tenant, not per request"),
    Refusal("kv_transfer_params", _set("kv_transfer_params"),
            "pdserve moves the KV between its workers itself"),
    Refusal("vllm_xargs", _set("vllm_xargs"), "no extension reads them"),
    Refusal("stream_options", lambda b: b.stream_options is not None and not b.stream,
            "only with stream: true"),
    Refusal("stream_options.include_obfuscation",
            lambda b: b.stream_options is not None and b.stream_options.include_obfuscation,
            "stream obfuscation is not supported"),
)  # fmt: skip

COMPLETIONS: tuple[Refusal, ...] = (
    Refusal("logprobs", lambda b: b.logprobs is not None and b.logprobs > MAX_LOGPROBS,
            f"at most {MAX_LOGPROBS}"),
    Refusal("suffix", _nonempty("suffix"), "suffix (insertion) is not supported"),
    Refusal("prompt_embeds", _set("prompt_embeds"), "prompt embeddings are not supported"),
)  # fmt: skip

CHAT: tuple[Refusal, ...] = (
    Refusal("top_logprobs", lambda b: b.top_logprobs is not None and b.top_logprobs > MAX_LOGPROBS,
            f"at most {MAX_LOGPROBS}"),
    Refusal("top_logprobs", lambda b: bool(b.top_logprobs) and not b.logprobs,
            "needs logprobs: true"),
    Refusal("functions", _nonempty("functions"),
            "the deprecated function calls are not supported; use tools"),
    Refusal("function_call", lambda b: b.function_call not in (None, "none"),
            "the deprecated function calls are not supported; use tool_choice"),
    Refusal("audio", _set("audio"), "audio output is not supported"),
    Refusal("modalities", lambda b: b.modalities not in (None, ["text"]), "only text"),
    Refusal("metadata", _set("metadata"), "stored completions are not supported"),
    Refusal("store", _set("store"), "stored completions are not supported"),
    Refusal("prediction", _set("prediction"), "predicted outputs are not supported"),
    Refusal("reasoning_effort", _set("reasoning_effort"), "reasoning effort is not supported"),
    Refusal("service_tier", lambda b: b.service_tier not in (None, "auto", "default"),
            "one tier: auto or default"),
    Refusal("verbosity", _set("verbosity"), "verbosity is not supported"),
    Refusal("web_search_options", _set("web_search_options"), "web search is not supported"),
    Refusal("echo", _set("echo"), "echo is not supported for chat"),
    Refusal("continue_final_message",
            lambda b: b.continue_final_message and b.add_generation_prompt,
            "cannot be used with add_generation_prompt: true"),
    Refusal("chat_template", _set("chat_template"),
            "templates from the request are not taken; start the gateway with --chat-template"),
    Refusal("mm_processor_kwargs", _set("mm_processor_kwargs"),
            "multimodal input is not supported"),
)  # fmt: skip


def _message_refusals(body: ChatCompletionRequest) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for i, message in enumerate(body.messages):
        for name in ("audio", "function_call"):
            if getattr(message, name) is not None:
                out.append((f"messages[{i}].{name}", f"{name} in messages is not supported"))
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "text":
                    out.append((f"messages[{i}].content[{j}].type",
                                f"{part.type!r} parts are not supported; only text"))  # fmt: skip
    return out


def refusals(body: SamplingFields) -> list[tuple[str, str]]:
    """(field, why) of each field of ``body`` set to something the gateway does not do."""
    table = COMPLETIONS if isinstance(body, CompletionRequest) else CHAT
    out = [(r.field, r.why) for r in (*SHARED, *table) if r.applies(body)]
    if isinstance(body, ChatCompletionRequest):
        out += _message_refusals(body)
    return out
