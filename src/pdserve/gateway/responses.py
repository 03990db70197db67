"""The OpenAI response bodies the gateway sends, as pydantic models (serialised with
``model_dump(mode="json")``).

``token_ids`` (vLLM's ``return_token_ids``), ``prompt_logprobs`` (vLLM's), ``service_tier``, a
message's ``tool_calls`` and a chat delta's ``role``/``content``/``tool_calls`` (and a tool call
delta's parts not in it) are left out of the JSON when unset, as OpenAI leaves them out; every
other field is always present, with ``null`` where OpenAI sends ``null``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from pdserve.client import Usage as ClientUsage


class _OmitsNone(BaseModel):
    """A body whose fields named in ``_omit_if_none`` are left out of the JSON when None."""

    _omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in self._omit_if_none:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens served from a worker's prefix cache."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def total(cls, per_prompt: list[ClientUsage], completion_tokens: int) -> Usage:
        """Usage of a batch: each prompt counted once, every choice's completion tokens."""
        prompt = sum(u.prompt_tokens for u in per_prompt)
        cached = sum(u.cached_tokens for u in per_prompt)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion_tokens,
            total_tokens=prompt + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


# -- /v1/completions -----------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: per token its text, logprob, the ``logprobs`` most likely
    tokens with the sampled one added (a dict of text -> logprob), and its offset. An echoed
    prompt's first token has none: ``null`` in ``token_logprobs`` and ``top_logprobs``."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)
    """Offset of each token's text: the sum of the texts of the tokens before it."""


class PromptTokenLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs``: one token at one prompt position."""

    logprob: float
    rank: int
    """1 + how many tokens the model found more likely there."""
    decoded_token: str


PromptLogprobList = list[dict[str, PromptTokenLogprob] | None]
"""vLLM's ``prompt_logprobs``: per prompt token, ``null`` for the first, then token id ->
entry for the prompt's token and the alternatives asked for."""


class CompletionChoice(_OmitsNone):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobList | None = None

    _omit_if_none = ("token_ids", "prompt_logprobs")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- /v1/chat/completions ------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments as JSON text (an object), as OpenAI gives them."""


class ToolCall(BaseModel):
    """One call of a function the request offered (``tools``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_OmitsNone):
    """``content`` is null when the answer is tool calls alone; ``tool_calls`` is left out
    when there are none, as OpenAI leaves it out."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    _omit_if_none = ("tool_calls",)


class ChatChoice(_OmitsNone):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None

    _omit_if_none = ("token_ids",)


class ChatCompletion(_OmitsNone):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    service_tier: str | None = None
    """``default`` when the request named a tier (``auto`` or ``default``)."""
    prompt_logprobs: PromptLogprobList | None = None

    _omit_if_none = ("service_tier", "prompt_logprobs")


class FunctionCallDelta(_OmitsNone):
    name: str | None = None
    """On a call's first delta only."""
    arguments: str | None = None
    """The next piece of the arguments' JSON text."""

    _omit_if_none = ("name", "arguments")


class ToolCallDelta(_OmitsNone):
    """A piece of tool call ``index`` of a streamed choice: the first carries ``id``,
    ``type`` and the function's ``name`` (and ``arguments: ""`` or their first piece), the
    next ones more of the arguments, as OpenAI streams them."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    _omit_if_none = ("id", "type")


class ChatDelta(_OmitsNone):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    _omit_if_none = ("role", "content", "tool_calls")


class ChatChunkChoice(_OmitsNone):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None

    _omit_if_none = ("token_ids",)


class ChatCompletionChunk(_OmitsNone):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    service_tier: str | None = None

    _omit_if_none = ("service_tier",)


# -- /v1/models, errors --------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str
    """The checkpoint directory the cluster serves."""
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_OmitsNone):
    """vLLM's ``POST /tokenize`` answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
    """With ``return_token_strs``: each token's text."""

    _omit_if_none = ("token_strs",)


class DetokenizeResponse(BaseModel):
    """vLLM's ``POST /detokenize`` answer."""

    prompt: str


class VersionResponse(BaseModel):
    """``GET /version``: pdserve's version."""

    version: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
